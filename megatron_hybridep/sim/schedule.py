"""The program one rank runs per iteration: compute phases and collectives in runtime order.

``runtime`` (default) follows the code, not the paper:
- after the optimizer step (runtime/context.py after_optimizer_step) the first MoE layer's expert
  all-gather starts, so it overlaps that layer's attention;
- MoE layer l, forward (megatron/moe_layer.py): attention etc. (T_pre); the token dispatch
  all-to-all over the rail (blocking); wait for layer l's gather (``DomainGather.borrowed``);
  experts; ``after_experts`` starts layer l+1's gather, which then overlaps layer l's combine
  all-to-all (blocking), layer l+1's attention and dispatch: it shares their links;
- borrowed copies (``gather``, the runtime's --hybridep-borrowed-copies, resolved per plan by
  plan/cost.py): "iteration" gathers in the first micro-batch only, keeps the copies for the
  iteration and returns the accumulated gradients once, in the last micro-batch's backward;
  "microbatch" gathers again in every micro-batch (the next micro-batch's ``forward()`` starts
  layer 0's after its attention, the others from ``after_experts``) and returns the gradient of
  every micro-batch's copies;
- backward, per layer in reverse: combine's transpose (blocking), expert backward (2x forward),
  the gradient return to the owners (blocking, in ``_Gathered.backward``: a reduce-scatter, or an
  all-to-all of top-k payloads when gradients are compressed), the dispatch's transpose
  (blocking), attention backward (2x T_pre);
- after the last micro-batch Megatron's finalize_model_grads all-reduces the dense gradients over
  the data-parallel group, then the expert gradients over the expert data-parallel replicas
  (sim/simulate.py appends them, blocking; with the workload's overlap_grad_reduce /
  overlap_param_gather it then hides them as tier b does, and with PP > 1 it puts tier b's
  pipeline schedule around the simulated stage: ``_pipeline_and_overlap``);
- shared+residual compression refreshes the shared expert inside ``DomainGather.start()`` (a
  blocking all-reduce over the EP group, every refresh_every steps: its bytes come amortised per
  step), before the first gather of each layer in a step;
- hot-expert replicas (plan.replicas, runtime/replication.py): ``start_gather`` starts the replica
  weights all-to-all (owner -> replica rank, exact) right after the gather, so it is prefetched
  with it; ``preprocess`` waits for it before the dispatch (replica_experts.py), so layer 0 of
  micro-batches after the first, started at its MoE block, hides behind nothing; in the backward
  the replicas' gradients go back to the owners (blocking) after the dispatch's transpose, before
  attention's backward.
- compression: the codec's compute (plan/cost.py ``codec_compute``) runs where nothing is in flight,
  once per gather after the wait (the encode after the optimizer step is counted there too) and once
  per return before it, as tier b prices it: exposed.

Tier b (plan/cost.py) is the closed form of ``runtime`` in both modes. ``paper`` is the paper's stream
model as a schedule: layer l's gather starts with layer l's T_pre and is waited for before the
dispatch (T = max(T_pre, AG) + 2 A2A), once per iteration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.phases import EXPOSED, Phase
from megatron_hybridep.sim.engine import BLOCK, COMPUTE, START, WAIT, Instr

SCHEDULES = ("runtime", "paper")
GATHER_MODES = ("auto", "iteration", "microbatch", "micro-batch")  # "micro-batch": the older spelling

# the exposed-time phases (plan/phases.py): they sum to the iteration time
PHASES = EXPOSED


@dataclass(frozen=True)
class SimOptions:
    schedule: str = "runtime"
    gather: str | None = None        # borrowed copies: None/"auto" = the workload's mode as tier b resolves it
    #   per plan; "iteration" or "microbatch" force one
    backward: bool = True            # False: forward passes only (the paper's model has no backward)
    dense_grad_bytes: float | None = None  # dense gradients per rank all-reduced over the data-parallel group
    #   after the backward (None: the workload's, as tier b prices them; 0: left out)

    def __post_init__(self) -> None:
        if self.gather == "micro-batch":
            object.__setattr__(self, "gather", "microbatch")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"schedule: unknown {self.schedule!r}; fix: use one of {', '.join(SCHEDULES)}")
        if self.gather is not None and self.gather not in GATHER_MODES:
            raise PlanError(f"gather: unknown {self.gather!r}; fix: use one of {', '.join(GATHER_MODES)}")
        if self.dense_grad_bytes is not None and not self.dense_grad_bytes >= 0:
            raise PlanError(f"dense_grad_bytes: must be >= 0, got {self.dense_grad_bytes!r}")


@dataclass(frozen=True)
class LayerWork:
    """What one MoE layer does on the simulated rank."""

    t_pre: float                 # forward compute before the experts
    expert: float                # forward expert compute (busiest rank)
    dispatch: str                # collective names
    combine: str
    codec_gather: float = 0.0    # the codec's compute per gather / per return (compressed domains)
    codec_return: float = 0.0


def build_program(layers: Sequence[LayerWork], micro_batches: int, *, gather: str | None,
                  grad_return: str | None, shared_sync: str | None, options: SimOptions,
                  present: set[str] | None = None, replicas: str | None = None,
                  replica_grad: str | None = None) -> list[Instr]:
    """Instructions of one iteration on one rank of an EP group (world-level collectives are
    appended by the caller). ``gather``/``grad_return``/``shared_sync``/``replicas`` (the replica
    weights)/``replica_grad``: collective names or None; ``present``: the collectives that move
    bytes (others, e.g. the all-to-all of S = G, are skipped)."""
    names = (gather, grad_return, shared_sync, replicas, replica_grad)
    if present is not None:
        gather, grad_return, shared_sync, replicas, replica_grad = (x if x in present else None for x in names)
    once = options.gather == "iteration" or options.schedule == "paper"
    runtime = options.schedule == "runtime"
    prog: list[Instr] = []
    add = prog.append
    Lm = len(layers)

    def key(op: str | None, mb: int, layer: int) -> str:
        return f"{op}@{mb}.{layer}"  # _reports reads the collective's name before the @

    def gathers(mb: int) -> bool:
        return gather is not None and (mb == 0 or not once)

    def returns(mb: int) -> bool:
        return grad_return is not None and (mb == micro_batches - 1 or not once)

    def exchanges(mb: int) -> bool:  # replicas follow the gather's rhythm (runtime: every micro-batch)
        return replicas is not None and (mb == 0 or not once)

    def gives_back(mb: int) -> bool:
        return replica_grad is not None and (mb == micro_batches - 1 or not once)

    def refresh(layer: int, stage: str) -> None:
        # DomainGather.start() refreshes the shared expert (a blocking all-reduce over the EP group,
        # amortised per step) right before the first gather of each layer in a step
        if shared_sync is not None:
            add(Instr(BLOCK, Phase.SHARED_SYNC, op=shared_sync, layer=layer, micro_batch=0, stage=stage))

    def start(layer: int, mb: int, stage: str) -> None:
        # HybridEPMoELayer.start_gather: the domain gather (after its refresh), then the replica weights
        at = _at(layer, mb, stage)
        if gathers(mb):
            if mb == 0 and runtime:
                refresh(layer, stage)
            add(at(START, Phase.EXPERT_ALLGATHER, op=gather, key=key(gather, mb, layer)))
        if exchanges(mb):
            add(at(START, Phase.REPLICA_WEIGHTS, op=replicas, key=key(replicas, mb, layer)))

    def wait_gather(at: Callable[..., Instr], mb: int, layer: int) -> None:
        if gathers(mb):
            add(at(WAIT, Phase.EXPERT_ALLGATHER, op=key(gather, mb, layer)))
            if runtime and layers[layer].codec_gather:  # the paper's model has no codec
                add(at(COMPUTE, Phase.EXPERT_ALLGATHER, seconds=layers[layer].codec_gather))

    def wait_replicas(at: Callable[..., Instr], mb: int, layer: int) -> None:
        if exchanges(mb):
            add(at(WAIT, Phase.REPLICA_WEIGHTS, op=key(replicas, mb, layer)))

    if runtime:
        start(0, 0, "step")   # after_optimizer_step
    else:
        for layer in range(Lm):
            refresh(layer, "step")
    for mb in range(micro_batches):
        for layer, w in enumerate(layers):
            at: Callable[..., Instr] = _at(layer, mb, "fwd")
            if not runtime:
                start(layer, mb, "fwd")
            add(at(COMPUTE, Phase.PRE_COMPUTE, seconds=w.t_pre))
            if not runtime:
                wait_gather(at, mb, layer)
                wait_replicas(at, mb, layer)
            if runtime and mb > 0 and layer == 0:
                start(0, mb, "fwd")                     # MoE forward(): nothing prefetches it
            if runtime:
                wait_replicas(at, mb, layer)            # preprocess: replica_experts, before the dispatch
            add(at(BLOCK, Phase.TOKEN_A2A_FWD, op=w.dispatch))
            if runtime:
                wait_gather(at, mb, layer)              # borrowed()
            add(at(COMPUTE, Phase.EXPERT_COMPUTE, seconds=w.expert))
            if runtime and layer + 1 < Lm:
                start(layer + 1, mb, "fwd")             # after_experts
            add(at(BLOCK, Phase.TOKEN_A2A_FWD, op=w.combine))
        if not options.backward:
            continue
        for layer in range(Lm - 1, -1, -1):
            w = layers[layer]
            at = _at(layer, mb, "bwd")
            add(at(BLOCK, Phase.TOKEN_A2A_BWD, op=w.dispatch))    # combine's transpose: same direction as dispatch
            add(at(COMPUTE, Phase.EXPERT_COMPUTE, seconds=2 * w.expert))
            if returns(mb):
                if runtime and w.codec_return:
                    add(at(COMPUTE, Phase.GRAD_RETURN, seconds=w.codec_return))
                add(at(BLOCK, Phase.GRAD_RETURN, op=grad_return))
            add(at(BLOCK, Phase.TOKEN_A2A_BWD, op=w.combine))     # dispatch's transpose
            if gives_back(mb):  # _Exchanged.backward: needs the dispatch's input gradient
                add(at(BLOCK, Phase.REPLICA_GRAD_RETURN, op=replica_grad))
            add(at(COMPUTE, Phase.PRE_COMPUTE, seconds=2 * w.t_pre))
    if present is not None:
        prog = [i for i in prog if i.kind not in (BLOCK, START) or i.op in present]
    return prog


def _at(layer: int, mb: int, stage: str) -> Callable[..., Instr]:
    def make(kind: str, phase: str, **kw: object) -> Instr:
        return Instr(kind, phase, layer=layer, micro_batch=mb, stage=stage, **kw)  # type: ignore[arg-type]
    return make
