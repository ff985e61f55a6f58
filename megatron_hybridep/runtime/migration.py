"""Expert migration inside a domain: all-gather the experts of every domain peer, and return the
gradients of the borrowed copies to their owners (the all-gather's transpose, a reduce-scatter).

One ``DomainGather`` per MoE layer and plan. ``start()`` launches the all-gather asynchronously (so
it overlaps attention and the previous layer); ``borrowed()`` waits and returns autograd-connected
copies: their gradients flow back through the reduce-scatter into the owners' parameters, so
Megatron's DDP hooks and optimizer see exactly what plain EP would give them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_hybridep.runtime.instrument import Stats

# torch >= 2.14 renamed the tensor-in/tensor-out collectives; older torch (>= 2.6 is supported) has the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Pending:
    """An in-flight all-gather: the buffer it fills and its handle."""

    def __init__(self, buffer: torch.Tensor, handle: dist.Work | None, started: float) -> None:
        self.buffer, self.handle, self.started = buffer, handle, started


class _Gathered(torch.autograd.Function):
    """y = all_gather(x) within the domain; dy -> reduce_scatter(dy) (sum of every peer's gradient
    for this rank's own chunk)."""

    @staticmethod
    def forward(ctx, flat_own: torch.Tensor, pending: _Pending, group: dist.ProcessGroup,  # noqa: ANN001
                stats: Stats | None, layer: int, levels: tuple[str, ...], position: int) -> torch.Tensor:
        ctx.group, ctx.stats, ctx.layer, ctx.numel = group, stats, layer, flat_own.numel()
        ctx.levels, ctx.position = levels, position
        if pending.handle is not None:
            pending.handle.wait()
        return pending.buffer

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        out = grad.new_empty(ctx.numel)
        t0 = time.perf_counter()
        _reduce_scatter(out, grad.contiguous(), group=ctx.group)
        if ctx.stats is not None:
            ctx.stats.add(ctx.layer, "grad_return", "domain", 0, time.perf_counter() - t0)
            _count_peer_bytes(ctx.stats, ctx.layer, "grad_return", ctx.levels, ctx.position,
                              out.numel() * out.element_size())
        return out, None, None, None, None, None, None


def _count_peer_bytes(stats: Stats | None, layer: int, phase: str, levels: Sequence[str], me: int,
                      nbytes: int) -> None:
    """One chunk of ``nbytes`` to every other domain member, counted per link level."""
    if stats is None:
        return
    for pos, level in enumerate(levels):
        if pos != me:
            stats.add(layer, phase, "domain", nbytes, 0.0, level=level)


class DomainGather:
    """All-gather of one MoE layer's expert parameters across a domain."""

    def __init__(self, params: Sequence[tuple[str, torch.nn.Parameter]], group: dist.ProcessGroup,
                 position: int, layer: int = 0, stats: Stats | None = None,
                 levels: Sequence[str] | None = None) -> None:
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.group, self.position, self.layer, self.stats = group, position, layer, stats
        self.size = dist.get_world_size(group)
        # link level towards each domain position, for per-level byte counts
        self.levels = tuple(levels) if levels is not None else ("all",) * self.size
        self.numel = sum(p.numel() for p in self.params)
        self._pending: _Pending | None = None

    @property
    def bytes_per_rank(self) -> int:
        """Expert bytes one rank ships to each peer (the P of the cost model, uncompressed)."""
        return self.numel * self.params[0].element_size()

    def start(self) -> None:
        """Launch the all-gather now (no-op if one is in flight). Parameters must not change until
        ``borrowed()``: start it after the optimizer step or within a forward pass."""
        if self._pending is not None or self.size == 1:
            return
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        buffer = flat.new_empty(self.size * self.numel)
        handle = _all_gather(buffer, flat, group=self.group, async_op=True)
        self._pending = _Pending(buffer, handle, time.perf_counter())

    def borrowed(self) -> list[dict[str, torch.Tensor] | None]:
        """Per domain position, the peer's expert parameters by name (None for this rank itself:
        owners compute with their own parameters). Starts the gather if nobody did."""
        if self.size == 1:
            return [None]
        self.start()
        pending, self._pending = self._pending, None
        assert pending is not None
        flat_own = torch.cat([p.reshape(-1) for p in self.params])  # the autograd path to the owners
        t0 = time.perf_counter()
        gathered = _Gathered.apply(flat_own, pending, self.group, self.stats, self.layer, self.levels,
                                   self.position)
        if self.stats is not None:
            self.stats.add(self.layer, "expert_gather", "domain", 0, time.perf_counter() - t0,
                           wall=time.perf_counter() - pending.started)
            self._count_bytes("expert_gather")
        out: list[dict[str, torch.Tensor] | None] = []
        for q, chunk in enumerate(gathered.split(self.numel)):
            if q == self.position:
                out.append(None)
                continue
            views, offset = {}, 0
            for name, p in zip(self.names, self.params, strict=True):
                views[name] = chunk[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            out.append(views)
        return out

    def _count_bytes(self, phase: str) -> None:
        _count_peer_bytes(self.stats, self.layer, phase, self.levels, self.position, self.bytes_per_rank)

    def drop(self) -> None:
        """Forget an in-flight gather (plan switch): wait so the buffer is not written later."""
        if self._pending is not None and self._pending.handle is not None:
            self._pending.handle.wait()
        self._pending = None
