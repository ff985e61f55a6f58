"""Expert migration inside a domain: all-gather the experts of every domain peer, and return the
gradients of the borrowed copies to their owners (the all-gather's transpose).

One ``DomainGather`` per MoE layer and plan. ``start()`` launches the all-gather asynchronously (so
it overlaps attention and the previous layer); ``borrowed()`` waits and returns autograd-connected
copies: their gradients flow back through the transpose into the owners' parameters, so Megatron's
DDP hooks and optimizer see exactly what plain EP would give them.

Compression (``MigrationConfig``): owners encode top-k(expert - base) with the codec; borrowers
rebuild base + residual. The base is the shared expert at the first gather (and after a plan
switch); with ``incremental`` (the default) it is afterwards the copy the peers already hold, so
each gather ships the largest entries of what the copy still misses (error feedback on weights):
borrowed copies converge to the owners' weights instead of staying shared + a fixed 2%. When the
shared expert is refreshed, every copy moves by its change, so drift common to all experts costs
no residual. Every
peer decodes the same payloads in the same order, so owner and borrowers agree on the copy bit for
bit without extra traffic. Owners always compute with their exact weights; the gradient computed
with a borrowed approximation is returned as the owner's gradient (straight-through), exactly or
top-k compressed with error feedback.

Borrowed copies per iteration (``MigrationConfig.hold_copies``, the default): a layer gathers
once per optimizer step and keeps the copies for every micro-batch of the iteration (and a
recomputed forward); their gradients accumulate and return to the owners once, in the iteration's
last backward (borrowed.py). Without it, every forward gathers and every backward returns.

Memory bound per layer and rank (n = numel of this rank's experts, S = domain size): while in
flight, one payload buffer of S x encoded(n); after decode, S x n held (own slot unused) for the
iteration (hold_copies) or for the micro-batch's backward, plus an fp32 gradient accumulator of
S x n while deferring; incremental compression keeps the S-1 copies between iterations plus one
mirror of n (what the peers hold of this rank's experts).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_hybridep.plan.phases import Phase
from megatron_hybridep.runtime.borrowed import views_of
from megatron_hybridep.runtime.compression import (
    ErrorFeedbackTopK,
    SharedExpertRule,
    SharedResidualCodec,
)
from megatron_hybridep.runtime.exchange import ExpertExchange
from megatron_hybridep.runtime.instrument import Stats
from megatron_hybridep.runtime.numerics import check_rows

# torch >= 2.14 renamed the tensor-in/tensor-out collectives; older torch (>= 2.6 is supported) has the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --hybridep-grad-compression-values: the dtype of a compressed gradient's kept values (None: the gradient's)
GRAD_VALUES = {"bf16": torch.bfloat16, "same": None}


@dataclass(frozen=True)
class MigrationConfig:
    """How experts move inside a domain. The defaults are exact (no compression)."""

    compression_ratio: float = 1.0       # element ratio of the expert weight codec (1 = exact)
    grad_compression_ratio: float = 1.0  # the same for returned gradients, with error feedback
    use_shared: bool = True              # shared + residual; False = plain top-k (the paper's ablation)
    shared_refresh_every: int = 10       # optimizer steps between shared-expert refreshes (0 = frozen)
    incremental: bool = True             # residual against the peers' current copy (else against shared)
    exact_first_gather: bool = True      # incremental: the first gather (and the first after a plan switch)
    #   ships the experts uncompressed, so copies start exact instead of from the shared expert
    hold_copies: bool = True             # one gather per optimizer step, gradients returned once per iteration
    async_return: bool = False           # that return launched in the last backward, collected before the reduction
    check_finite: bool = False           # --check-for-nan-in-loss-and-grad: name a non-finite borrowed expert
    grad_values: str = "bf16"            # kept values of compressed returned gradients: "bf16" (the rounding
    #   stays in the error-feedback accumulator, so nothing is lost) or "same" (the gradient's own dtype)
    grad_warmup_steps: int = 0           # returned gradients ramp from exact to grad_compression_ratio over
    #   this many optimizer steps, geometrically (Deep Gradient Compression's density warm-up)
    early_return_rest_ratio: float = 0.0  # > 0: the first M-1 micro-batches' returned gradient is launched in
    #   the (M-1)th backward (it crosses the link during the last micro-batch) and the last backward returns
    #   the rest at this ratio, a smaller payload on the step's tail (0 = one return; needs grad compression)

    def __post_init__(self) -> None:
        for name in ("compression_ratio", "grad_compression_ratio"):
            if not getattr(self, name) >= 1.0:
                raise ValueError(f"MigrationConfig.{name} must be >= 1 (1 = exact); got {getattr(self, name)}")
        if self.shared_refresh_every < 0:
            raise ValueError("MigrationConfig.shared_refresh_every must be >= 0 (0 = never refresh)")
        if self.grad_values not in GRAD_VALUES:
            raise ValueError(f"MigrationConfig.grad_values must be one of {sorted(GRAD_VALUES)}, got "
                             f"{self.grad_values!r}")
        if self.grad_warmup_steps < 0:
            raise ValueError("MigrationConfig.grad_warmup_steps must be >= 0 (0 = no warm-up)")
        if self.early_return_rest_ratio and not (self.compresses_grads and self.hold_copies
                                                 and self.early_return_rest_ratio >= 1.0):
            raise ValueError("MigrationConfig.early_return_rest_ratio (--hybridep-early-grad-return) needs compressed "
                             "returned gradients (--hybridep-grad-compression-ratio > 1), borrowed copies per "
                             f"iteration and a ratio >= 1; got {self.early_return_rest_ratio}")

    def grad_ratio_at(self, step: int) -> float:
        """The returned gradients' ratio in optimizer step ``step`` (0-based): exact at 0, then
        ``grad_compression_ratio ** (step / grad_warmup_steps)`` until the warm-up ends."""
        if step >= self.grad_warmup_steps:
            return self.grad_compression_ratio
        return self.grad_compression_ratio ** (step / self.grad_warmup_steps)

    @property
    def compresses_weights(self) -> bool:
        return self.compression_ratio > 1.0

    @property
    def compresses_grads(self) -> bool:
        return self.grad_compression_ratio > 1.0


class SharedExpert:
    """The shared expert of one MoE layer: the mean of all its experts' exact weights over the EP
    group, identical on every rank (an all-reduce result), refreshed by ``SharedExpertRule``."""

    def __init__(self, ep_group: dist.ProcessGroup, num_experts: int, refresh_every: int) -> None:
        self.group, self.num_experts = ep_group, num_experts
        self.rule = SharedExpertRule(refresh_every)
        self.tensor: torch.Tensor | None = None

    def _reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def update(self, step: int, rows: torch.Tensor) -> torch.Tensor:
        """The shared tensor for this step (computes it the first time and when the rule says)."""
        self.tensor = self.rule.maybe_refresh(step, self.tensor, list(rows.unbind(0)), self.num_experts,
                                              self._reduce_sum)
        return self.tensor

    def state_dict(self) -> dict[str, torch.Tensor | None]:
        """The tensor in use: a resumed run that recomputed it off the refresh schedule would encode
        against another base than the uninterrupted run (the schedule runs on the runtime's step)."""
        return {"tensor": self.tensor}

    def load_state_dict(self, state: dict[str, torch.Tensor | None]) -> None:
        self.tensor = state["tensor"]


class _Pending:
    """An in-flight all-gather: the buffer it fills, its handle, the shared tensor used, and the
    version of the owners' parameters it carries."""

    def __init__(self, buffer: torch.Tensor, handle: dist.Work | None, started: float,
                 shared: torch.Tensor | None, key: tuple[int, ...]) -> None:
        self.buffer, self.handle, self.started, self.shared, self.key = buffer, handle, started, shared, key


class _Gathered(torch.autograd.Function):
    """y = the domain's gathered experts (decoded if compressed), as a function of this rank's own
    parameters; dy -> the transpose: every peer's gradient for this rank's chunk, summed (owed
    until the runtime stops deferring)."""

    @staticmethod
    def forward(ctx, buffer: torch.Tensor, owner: DomainGather, *params: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.owner = owner
        return buffer.view_as(buffer)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        owner = ctx.owner
        return None, None, *owner.wgrad.to_params(owner.owed(owner.wgrad.take(grad)), owner.params)


class DomainGather(ExpertExchange):
    """All-gather of one MoE layer's expert parameters across a domain (runtime/exchange.py)."""

    def __init__(self, params: Sequence[tuple[str, torch.nn.Parameter]], group: dist.ProcessGroup,
                 position: int, layer: int = 0, stats: Stats | None = None,
                 levels: Sequence[str] | None = None, num_local: int = 1,
                 config: MigrationConfig | None = None, shared: SharedExpert | None = None,
                 defer: Callable[[], bool] | None = None, asynchronous: Callable[[], bool] | None = None,
                 fuse_wgrad: bool = False, micro_batches: Callable[[], int | None] | None = None) -> None:
        self.config = config or MigrationConfig()
        self._micro_batches = micro_batches or (lambda: None)
        self.group, self.position = group, position
        self.size = dist.get_world_size(group)
        super().__init__(params, num_local, layer=layer, stats=stats,
                         levels=tuple(levels) if levels is not None else ("all",) * self.size,
                         hold=self.config.hold_copies, defer=defer, asynchronous=asynchronous, fuse_wgrad=fuse_wgrad)
        self.shared = shared
        dtype = self.params[0].dtype
        # incremental: the codec's base is the peers' copy, which plain top-k seeds with zeros
        self.codec = (SharedResidualCodec(self.config.compression_ratio,
                                          use_shared=self.config.use_shared or self.config.incremental)
                      if self.config.compresses_weights else None)
        self.grad_codec = (ErrorFeedbackTopK(self.config.grad_compression_ratio,
                                             value_dtype=GRAD_VALUES[self.config.grad_values])
                           if self.config.compresses_grads else None)
        if self.codec is not None and (self.shared is None) == self.config.use_shared:
            raise ValueError("a shared+residual codec needs a SharedExpert (and plain top-k must not have one)")
        self.wire_bytes_per_rank = (num_local * self.codec.nbytes(self.row, dtype) if self.codec is not None
                                    else self.numel * self.params[0].element_size())
        self._step = 0
        # the borrowed copies in the gathered buffer: every peer's chunk laid out like this rank's
        self._peer_spans = tuple((q * self.numel + start, shape) for q in range(self.size) if q != position
                                 for start, shape in self.spans)
        # incremental compression: what the peers hold of this rank's experts [L, row], and what this
        # rank holds of every position [S, L, row] (own slot unused); None = rebuild from the shared base
        self._held: torch.Tensor | None = None
        self._copies: torch.Tensor | None = None
        self._held_shared: torch.Tensor | None = None  # the shared tensor each was last moved with
        self._copies_shared: torch.Tensor | None = None
        self._encoded: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None
        self._encoded_key: tuple[int, ...] | None = None

    @property
    def bytes_per_rank(self) -> int:
        """Bytes one rank ships to each peer per gather (the P of the cost model, after compression)."""
        return self.wire_bytes_per_rank

    def current_step(self) -> int:
        return self._step

    def on_step(self, step: int) -> None:
        """After the optimizer step: the counter the shared-expert rule runs on."""
        self._step = step

    def _encode(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """This rank's payload now: (payload, shared tensor used, base it was encoded against)."""
        flat = self._flat(detach=True)
        if self.codec is None:
            return flat, None, None
        rows = flat.view(self.num_local, -1)
        if not self.config.incremental:
            shared = self.shared.update(self._step, rows) if self.shared is not None else None
            return self.codec.encode_batch(rows, shared), shared, None
        # the shared expert seeds the copies; afterwards the base is the copy itself, moved by the
        # shared expert's change at each refresh (drift common to all experts costs no residual)
        shared = self.shared.update(self._step, rows) if self.shared is not None else None
        if self._held is None and self.config.exact_first_gather:
            return flat.clone(), shared, None  # the peers' first copy, exact (_finish: _copies is None)
        if self._held is None:
            base = self._initial_base(rows, shared)
        else:
            base = self._rebase(self._held, self._held_shared, shared)
        return self.codec.encode_batch(rows, base), shared, base

    def state_dict(self) -> dict[str, object]:
        """What the next gather builds on, between iterations (nothing in flight or owed): the
        incremental codec's copies (identical on owner and peers, so every rank saves its own) and
        the gradient codec's error-feedback residuals. A shared tensor that is the layer's current
        shared expert is saved as "shared": _shift tells "unchanged" by identity."""
        if self._pending is not None or self._encoded is not None or self.owed.owes:
            raise RuntimeError("DomainGather.state_dict: a gather or a gradient return is in flight; save "
                               "between the optimizer step and the runtime's post-step")
        current = self.shared.tensor if self.shared is not None else None

        def ref(t: torch.Tensor | None) -> torch.Tensor | str | None:
            return "shared" if t is not None and t is current else t

        return {"held": self._held, "held_shared": ref(self._held_shared), "copies": self._copies,
                "copies_shared": ref(self._copies_shared),
                "grad_residuals": self.grad_codec.state_dict() if self.grad_codec is not None else {}}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """After the layer's SharedExpert is loaded (the "shared" references resolve to it)."""
        current = self.shared.tensor if self.shared is not None else None

        def deref(t: object) -> torch.Tensor | None:
            return current if isinstance(t, str) else t  # type: ignore[return-value]

        self._forget_gathers()
        self._held, self._held_shared = deref(state["held"]), deref(state["held_shared"])
        self._copies, self._copies_shared = deref(state["copies"]), deref(state["copies_shared"])
        if self.grad_codec is not None:
            self.grad_codec.load_state_dict(state["grad_residuals"])  # type: ignore[arg-type]

    def encode_ahead(self) -> None:
        """Right after the optimizer step (compressed only): encode now, while the weights are fresh,
        and launch the gather later (prefetch order). Encoding again before a launch replaces it."""
        if self.codec is not None and self.size > 1 and self._pending is None and not self._holds_current():
            self._encoded, self._encoded_key = self._encode(), self.version()

    def start(self) -> None:
        """Launch the all-gather now: a no-op if one for the current parameters is in flight or their
        copies are held. Parameters must not change until ``borrowed()``: start it after the
        optimizer step or within a forward pass. A gather of older parameters (a prefetch that
        outlived a step) is waited for and dropped, never used."""
        key = None if self.size == 1 else self._version_to_launch()
        if key is None:
            return
        if self._encoded is not None and self._encoded_key != key:
            self._encoded = None
        payload, shared, base = self._encoded or self._encode()
        self._encoded = None
        if base is not None:  # what the peers will hold once they decode this payload
            self._held = self.codec.decode_batch(payload, base, out=base)  # in place: the base is private
            self._held_shared = shared
        elif self._exact_first():
            self._held, self._held_shared = payload.view(self.num_local, -1).clone(), shared
        buffer = payload.new_empty(self.size * payload.numel())
        handle = _all_gather(buffer, payload, group=self.group, async_op=True)
        self._pending = _Pending(buffer, handle, time.perf_counter(), shared, key)

    def borrowed(self) -> list[dict[str, torch.Tensor] | None]:
        """Per domain position, the peer's expert parameters by name (None for this rank itself:
        owners compute with their own parameters). Gathers if the copies of the current parameters
        are not held (starting the gather if nobody did)."""
        if self.size == 1:
            return [None]
        if self._holds_current():
            buffer = self._copy
        else:
            self.start()
            pending, self._pending = self._pending, None
            assert pending is not None
            buffer = self._finish(pending)
            self._copy, self._copy_key = (buffer, pending.key) if self.config.hold_copies else (None, None)
        gathered = _Gathered.apply(buffer, self, *self.params)
        tensors = iter(views_of(gathered, self._peer_spans))
        out: list[dict[str, torch.Tensor] | None] = [
            None if q == self.position else {name: next(tensors) for name in self.names} for q in range(self.size)]
        if self.wgrad.enabled:
            self.wgrad.attach(gathered, [v for views in out if views is not None for v in views.values()], self.params)
        return out

    # ---- called by _Gathered ----------------------------------------------------------------
    def _finish(self, pending: _Pending) -> torch.Tensor:
        t0 = time.perf_counter()
        if pending.handle is not None:
            pending.handle.wait()
        if self.codec is None:
            result = pending.buffer
        else:
            result = self.params[0].new_zeros(self.size * self.numel)
            slots = pending.buffer.view(self.size, -1)
            rows = result.view(self.size, self.num_local, -1)
            shift = self._shift(self._copies_shared, pending.shared)
            for q in range(self.size):
                if q == self.position:  # this rank's own slot is never used: owners are exact
                    continue
                if not self.config.incremental:
                    self.codec.decode_batch(slots[q], pending.shared, out=rows[q])
                elif self._copies is None and self.config.exact_first_gather:
                    rows[q].copy_(slots[q].view_as(rows[q]))
                elif self._copies is None:
                    self.codec.decode_batch(slots[q], self._initial_base(rows[q], pending.shared), out=rows[q])
                else:  # one launch per peer, the refresh's rebase folded in (Triton on GPU)
                    self.codec.decode_rows(slots[q], self._copies[q], out=rows[q], shift=shift)
            if self.config.check_finite:
                check_rows(rows, "decoded copy of a borrowed expert", self.layer,
                           dist.get_process_group_ranks(self.group), skip=self.position)
            if self.config.incremental:
                self._copies = rows.detach()  # never written in place: the next gather decodes into a new buffer
                self._copies_shared = pending.shared
        if self.stats is not None:
            self.stats.add(self.layer, Phase.EXPERT_ALLGATHER, "domain", 0, time.perf_counter() - t0,
                           wall=time.perf_counter() - pending.started)
            self.stats.add_borrowed(self.layer, (self.size - 1) * self.numel * result.element_size())
            sent = pending.buffer.numel() // self.size * pending.buffer.element_size()  # exact first: dense
            self._count_bytes(Phase.EXPERT_ALLGATHER, sent)
        return result

    def _exact_first(self) -> bool:
        """The next gather ships the experts uncompressed (the incremental codec's first)."""
        return self.codec is not None and self.config.incremental and self.config.exact_first_gather \
            and self._held is None

    @staticmethod
    def _shift(old: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
        """The shared expert's change since the copies were built (None: unchanged)."""
        if new is None or old is None or new is old:
            return None
        return (new - old).reshape(-1)

    @classmethod
    def _rebase(cls, copy: torch.Tensor, old: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor:
        """The copy, moved by the shared expert's refresh since it was built (a new tensor when
        moved, ``copy`` itself otherwise). Owner and peers apply the same shift to the same copy."""
        shift = cls._shift(old, new)
        return copy if shift is None else copy + shift.reshape(1, -1)

    def _initial_base(self, rows: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
        """The first copy peers build on: the shared expert (plain top-k: zeros), one per expert row."""
        if shared is None:
            return torch.zeros_like(rows)
        return shared.reshape(1, -1).expand_as(rows).clone()

    def _early_launchers(self) -> tuple[Callable, Callable] | None:
        rest = self.config.early_return_rest_ratio
        if not rest:
            return None
        return self._launch_return, lambda grad: self._launch_return(grad, ratio=rest)

    def _split_at(self) -> int | None:
        """The deferred backward that launches the early return: M-1, once any warm-up is over."""
        m = self._micro_batches()
        if not m or m < 2 or self._step < self.config.grad_warmup_steps:
            return None
        return m - 1

    def _launch_return(self, grad: torch.Tensor, ratio: float | None = None) -> Callable[[], torch.Tensor]:
        """Start returning ``grad`` (S chunks: one per domain position) to the owners; the function
        returned waits and gives this rank's summed chunk. ``ratio``: the compressed payload's (default:
        the gradient ratio of this step)."""
        t0 = time.perf_counter()
        grad = grad.contiguous()
        if self.config.check_finite:
            check_rows(grad.view(self.size, self.num_local, -1), "gradient of a borrowed expert", self.layer,
                       dist.get_process_group_ranks(self.group), skip=self.position)
        out = grad.new_zeros(self.numel)
        nbytes = self.numel * grad.element_size()
        if self.grad_codec is None and dist.get_backend(self.group) == "gloo":
            # gloo's reduce-scatter is an all-reduce plus a slice (2x the bytes on the wire); an
            # all-to-all of the chunks and a local sum sends each chunk once, like NCCL's ring.
            recv = torch.empty_like(grad)
            work = dist.all_to_all_single(recv, grad, group=self.group, async_op=True)

            def done() -> None:
                torch.sum(recv.view(self.size, -1), dim=0, out=out)
        elif self.grad_codec is None:
            work = _reduce_scatter(out, grad, group=self.group, async_op=True)

            def done() -> None:
                pass
        else:
            chunks = grad.view(self.size, -1)
            # from the step: resumes exactly
            self.grad_codec.ratio = sent_at = self.config.grad_ratio_at(self._step) if ratio is None else ratio
            nbytes = self.grad_codec.nbytes(self.numel, grad.dtype)
            send = torch.zeros(self.size, nbytes, dtype=torch.uint8, device=grad.device)
            for q in range(self.size):
                if q != self.position:
                    self.grad_codec.compress((self.layer, q), chunks[q], out=send[q])
            recv = torch.empty_like(send)
            work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)

            def done() -> None:
                for q in range(self.size):
                    if q != self.position:
                        self.grad_codec.decompress(recv[q], out=out, accumulate=True, ratio=sent_at)
        launched = time.perf_counter() - t0

        def finish() -> torch.Tensor:
            t1 = time.perf_counter()
            work.wait()
            done()
            if self.stats is not None:  # time this rank spent on it: launching + waiting
                self.stats.add(self.layer, Phase.GRAD_RETURN, "domain", 0, launched + time.perf_counter() - t1)
                self._count_bytes(Phase.GRAD_RETURN, nbytes)
            return out

        return finish

    def _count_bytes(self, phase: str, nbytes: int) -> None:
        """One chunk of ``nbytes`` to every other domain member, counted per link level."""
        if self.stats is None:
            return
        for pos, level in enumerate(self.levels):
            if pos != self.position:
                self.stats.add(self.layer, phase, "domain", nbytes, 0.0, level=level)

    def _forget_gathers(self) -> None:
        """Wait for an in-flight gather (its buffer must not be written later) and forget it, the
        held copies and the incremental codec state (the next gather rebuilds from the shared base;
        every rank forgets at the same point, so owners and peers stay in step)."""
        if self._pending is not None:
            if self._pending.handle is not None:
                self._pending.handle.wait()
            self._count_bytes(Phase.EXPERT_ALLGATHER, self.bytes_per_rank)  # its bytes crossed the links all the same
        self._pending = self._encoded = None
        self._copy = self._copy_key = None
        self._held = self._copies = None

    def _forget_stale(self) -> None:
        self._forget_gathers()

    def drop(self) -> None:
        """Plan switch: forget gathers and copies. Called between iterations, so nothing is owed."""
        self._forget_gathers()
        self.owed.forget()
