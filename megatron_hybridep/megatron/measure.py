"""Bytes over each link level, counted the same way for every system (alltoall EP, replicated,
hybridep): logical bytes each rank sends to each peer, attributed to the coarsest topology level
that peer is across ('dc' = inter-DC links).

- token all-to-alls: Megatron's dispatcher instrumented (dispatcher.instrument), hybridep's or not;
- expert gathers, gradient returns, replica exchanges: the runtime's own counters (same Stats);
- Megatron's gradient reductions (dense and expert data-parallel, in finalize_model_grads): a
  reduce-scatter + all-gather of each DDP buffer, i.e. 2 B / n to each of the n - 1 peers.
The collectives' algorithms (ring, tree) move the same bytes over other paths; the testbed's link
counters measure those. This is what each system asks the network to move.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_hybridep.plan.grid import coords_of
from megatron_hybridep.plan.phases import Phase
from megatron_hybridep.plan.topology import Topology
from megatron_hybridep.runtime.context import Measuring, process_context
from megatron_hybridep.runtime.instrument import Stats


def enable(topology: Topology, stats: Stats | None = None) -> Stats:
    """Count from now on into ``stats`` (a new one if None): call before building the model."""
    ctx = process_context()
    ctx.measuring = Measuring(topology, stats or Stats())
    ctx.restart_layers()
    return ctx.measuring.stats


def disable() -> None:
    ctx = process_context()
    ctx.measuring = None
    ctx.restart_layers()


def stats() -> Stats | None:
    measuring = process_context().measuring
    return measuring.stats if measuring is not None else None


def level(a: int, b: int) -> str:
    """The coarsest topology level global ranks a and b differ at ('local' if a == b)."""
    topo = process_context().measuring.topology
    for name, ca, cb in zip(topo.level_names, coords_of(a, topo.level_counts), coords_of(b, topo.level_counts),
                            strict=True):
        if ca != cb:
            return name
    return "local"


def levels_towards(group_ranks: Sequence[int], me: int) -> tuple[str, ...]:
    """Link level from global rank ``me`` to each member of a group, in group order."""
    return tuple(level(me, r) for r in group_ranks)


def count_grad_reductions(model_chunks: Sequence[Any]) -> None:
    """Megatron DDP's reductions of one iteration (buffers of dense and expert parameters)."""
    import torch.distributed as dist

    s = stats()
    if s is None:
        return
    me = dist.get_rank()
    for chunk in model_chunks:
        for phase, buffers in ((Phase.DENSE_GRAD_ALLREDUCE, getattr(chunk, "buffers", [])),
                               (Phase.EXPERT_GRAD_ALLREDUCE, getattr(chunk, "expert_parallel_buffers", []))):
            for buf in buffers:
                group = buf.data_parallel_group
                ranks = dist.get_process_group_ranks(group)
                n = len(ranks)
                per_peer = 2 * buf.grad_data.numel() * buf.grad_data.element_size() // n
                for r in ranks:
                    if r != me:
                        s.add(0, phase, "dp", per_peer, 0.0, level=level(me, r))


def schedule_kwargs(config: Any) -> dict[str, Any]:
    """Extra arguments for Megatron's pipeline schedules: under PP, while counting, a P2P
    communicator that counts each activation / activation-gradient send at its link level
    (Megatron builds a plain one when given none)."""
    from megatron.core import parallel_state as ps

    if stats() is None or ps.get_pipeline_model_parallel_world_size() == 1:
        return {}
    from megatron.core.process_groups_config import ProcessGroupCollection

    return dict(p2p_communicator=_counting_p2p()(ps.get_pipeline_model_parallel_group(), config),
                pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def _counting_p2p() -> type:
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    class CountingP2P(P2PCommunicator):
        def _communicate(self, *, tensor_send_next: Any, tensor_send_prev: Any, **kwargs: Any) -> Any:
            import torch.distributed as dist

            s, me = stats(), dist.get_rank()
            for tensor, peer in ((tensor_send_next, self.next_rank), (tensor_send_prev, self.prev_rank)):
                if s is not None and tensor is not None and peer is not None:
                    s.add(0, Phase.PIPELINE_SEND, "pp", tensor.numel() * tensor.element_size(), 0.0,
                          level=level(me, peer))
            return super()._communicate(tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev,
                                        **kwargs)

    return CountingP2P
