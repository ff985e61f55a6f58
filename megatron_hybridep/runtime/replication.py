"""Hot-expert replicas at run time: ship the owners' weights of replicated experts to the ranks that
hold replicas (plan.replicas), and return the replicas' gradients to the owners (the transpose).

One ``ReplicaExchange`` per MoE layer and plan. Both directions are one all-to-all over the EP group
(every rank joins, most with empty splits): forward, each owner sends expert e's flat weights to
every replica rank of e; backward, each replica rank sends the gradient of its copy back, and the
owner adds it to e's gradient, so owners' gradients equal plain EP's. ``start()`` issues the forward
asynchronously (prefetched like the domain gather); ``exchange(hidden)`` waits and returns
autograd-connected copies. The exchange threads the layer's hidden states through the same autograd
node, so its backward runs after the layer's own backward collectives on every rank, in the same
order (a collective whose place in the backward differed between ranks could deadlock).
Replicas are always exact (the codec of the domain gather is not applied to them). Like the
domain gather, with ``hold`` the weights are exchanged once per optimizer step and the replicas'
gradients are owed until the iteration's last backward (borrowed.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_hybridep.plan.phases import Phase
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.runtime.borrowed import views_of
from megatron_hybridep.runtime.exchange import ExpertExchange
from megatron_hybridep.runtime.instrument import Stats


class _Pending:
    def __init__(self, recv: torch.Tensor, handle: dist.Work, started: float, key: tuple[int, ...]) -> None:
        self.recv, self.handle, self.started, self.key = recv, handle, started, key


class _Exchanged(torch.autograd.Function):
    """(hidden, own experts) -> (hidden, replica weights); backward: gradients back to owners."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, recv: torch.Tensor, owner: ReplicaExchange,  # noqa: ANN001
                *params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.owner = owner
        return hidden.view_as(hidden), recv.view_as(recv)

    @staticmethod
    def backward(ctx, grad_hidden: torch.Tensor, grad_recv: torch.Tensor):  # noqa: ANN001, ANN205
        owner = ctx.owner
        return grad_hidden, None, None, *owner.wgrad.to_params(owner.owed(owner.wgrad.take(grad_recv)), owner.params)


class ReplicaExchange(ExpertExchange):
    """Replica weights of one MoE layer under one plan, for this EP rank (runtime/exchange.py)."""

    def __init__(self, params: Sequence[tuple[str, torch.nn.Parameter]], num_local: int, plan: Plan,
                 ep_rank: int, group: dist.ProcessGroup, layer: int = 0, stats: Stats | None = None,
                 levels: Sequence[str] | None = None, hold: bool = False,
                 defer: Callable[[], bool] | None = None, asynchronous: Callable[[], bool] | None = None,
                 step: Callable[[], int] | None = None, fuse_wgrad: bool = False) -> None:
        super().__init__(params, num_local, layer=layer, stats=stats,
                         levels=tuple(levels) if levels is not None else ("all",) * plan.ep_size, hold=hold,
                         defer=defer, asynchronous=asynchronous, fuse_wgrad=fuse_wgrad)
        self.group = group
        self.per_param = len(self.params) // num_local          # tensors per expert
        G, L, me = plan.ep_size, plan.experts_per_rank, ep_rank
        pairs = plan.replicas.pairs
        # sends ordered by (destination, expert); receives by (owner, expert): the same order on both ends
        self.send_rows = torch.tensor([e - me * L for e, r in sorted(pairs, key=lambda p: (p[1], p[0]))
                                       if e // L == me], dtype=torch.long)
        self.experts = tuple(sorted((e for e, r in pairs if r == me), key=lambda e: (e // L, e)))
        self.in_splits = [self.row * sum(1 for e, r in pairs if r == q and e // L == me) for q in range(G)]
        self.out_splits = [self.row * sum(1 for e in self.experts if e // L == q) for q in range(G)]
        self._step_of = step or (lambda: 0)  # the runtime's optimizer-step count
        # each received replica is a row laid out like one local expert's parameters
        self._replica_spans = tuple((i * self.row + start, shape) for i in range(len(self.experts))
                                    for start, shape in self.spans[: self.per_param])

    def current_step(self) -> int:
        return self._step_of()

    def start(self) -> None:
        """Issue the weight all-to-all now (no-op if in flight). Weights must not change until
        ``exchange``: call after the optimizer step or within the forward pass. An exchange of older
        weights (a prefetch that outlived a step) is waited for and dropped."""
        key = self._version_to_launch()
        if key is None:
            return
        flat = self._flat(detach=True).view(self.num_local, self.row)
        send = flat.index_select(0, self.send_rows).reshape(-1)
        recv = flat.new_empty(sum(self.out_splits))
        handle = dist.all_to_all_single(recv, send, self.out_splits, self.in_splits, group=self.group,
                                        async_op=True)
        self._pending = _Pending(recv, handle, time.perf_counter(), key)

    def exchange(self, hidden: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, list[torch.Tensor]]]]:
        """``hidden`` (threaded through) and, per replicated expert this rank holds, its weight
        tensors in the order of one local expert's parameters (see ``slot_names``)."""
        if self._holds_current():
            recv = self._copy
        else:
            self.start()
            pending, self._pending = self._pending, None
            recv = self._finish(pending)
            self._copy, self._copy_key = (recv, pending.key) if self.hold else (None, None)
        hidden, recv = _Exchanged.apply(hidden, recv, self, *self.params)
        tensors = views_of(recv, self._replica_spans)
        k = self.per_param
        out = [(e, list(tensors[i * k:(i + 1) * k])) for i, e in enumerate(self.experts)]
        if self.wgrad.enabled:
            self.wgrad.attach(recv, [t for _, tensors in out for t in tensors], self.params)
        return hidden, out

    def slot_names(self, slot: int) -> list[str]:
        """Parameter names of local expert slot ``slot`` (a replica runs in a slot's place)."""
        return self.names[slot * self.per_param:(slot + 1) * self.per_param]

    # ---- called by _Exchanged ------------------------------------------------------------------
    def _finish(self, pending: _Pending) -> torch.Tensor:
        t0 = time.perf_counter()
        pending.handle.wait()
        self._count(Phase.REPLICA_WEIGHTS, self.in_splits, time.perf_counter() - t0,
                    time.perf_counter() - pending.started)
        return pending.recv

    def _launch_return(self, grad_recv: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start sending the replicas' gradients to their owners; the function returned waits and
        gives this rank's experts' share, summed."""
        t0 = time.perf_counter()
        grad_send = grad_recv.new_empty(sum(self.in_splits))
        work = dist.all_to_all_single(grad_send, grad_recv.contiguous(), self.in_splits, self.out_splits,
                                      group=self.group, async_op=True)
        launched = time.perf_counter() - t0

        def finish() -> torch.Tensor:
            t1 = time.perf_counter()
            work.wait()
            grad = grad_recv.new_zeros(self.num_local, self.row)
            grad.index_add_(0, self.send_rows, grad_send.view(-1, self.row))
            self._count(Phase.REPLICA_GRAD_RETURN, self.out_splits, launched + time.perf_counter() - t1)
            return grad.view(-1)

        return finish

    def _count(self, phase: str, splits: list[int], seconds: float, wall: float = 0.0) -> None:
        """Bytes this rank sends, per destination's link level, and the time."""
        if self.stats is None:
            return
        self.stats.add(self.layer, phase, "ep", 0, seconds, wall=wall)
        size = self.params[0].element_size()
        for q, n in enumerate(splits):
            if n:
                self.stats.add(self.layer, phase, "ep", n * size, 0.0, level=self.levels[q])

    def _forget_stale(self) -> None:
        self.drop()

    def drop(self) -> None:
        """Forget an in-flight exchange and held weights (plan switch, stale prefetch)."""
        if self._pending is not None:
            self._pending.handle.wait()
        self._pending = None
        self._copy = self._copy_key = None
