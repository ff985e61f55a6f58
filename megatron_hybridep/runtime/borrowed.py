"""What borrowed expert weights owe their owners, shared by the domain gather and hot replicas.

Borrowed copies belong to the owners' parameters as they were when gathered: ``version_key`` reads
the parameters' in-place version counters, which every optimizer step bumps (Megatron's optimizers
write parameters in place), so a copy or an in-flight gather from before a step is never used after
it, even by a caller that does not tell the runtime about its steps.

The gradient computed with a copy is owed to its owner. While the runtime defers (the
micro-batches Megatron runs under ``no_sync``), it accumulates here, in at least fp32 like
Megatron's main grads; the first backward outside ``no_sync`` (the iteration's last micro-batch)
returns the sum once, launched asynchronously when the loop collects it before Megatron's gradient
reduction (grad_sync.py). With an early part (--hybridep-early-grad-return, compressed returns only)
the sum of the first M-1 micro-batches is launched in the (M-1)th backward, so it crosses the link
during the last micro-batch, and the last backward returns only the rest, in a smaller payload.
Nothing owed may survive to the optimizer step (``owes``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def version_key(params: Sequence[torch.Tensor], step: int = 0) -> tuple[int, ...]:
    """The runtime's optimizer-step count (after_optimizer_step) and the parameters' versions: either
    moving makes a copy stale (a loop that does not report steps, an optimizer writing ``.data``)."""
    return (step, *(p._version for p in params))


Launch = Callable[[torch.Tensor], Callable[[], torch.Tensor]]


class OwedGradient:
    """Accumulates a borrowed copy's gradient while ``defer()``; otherwise returns the total to the
    owners: through autograd (``send``, blocking), or, when ``asynchronous()``, launched now
    (``launch`` -> a function that waits and gives the owners' gradient) and collected by ``flush``
    before Megatron reduces gradients, so the return overlaps the rest of the backward pass.

    ``early`` = (launch_early, launch_rest): at the ``split_at()``-th deferred backward of an
    iteration (M-1: the micro-batches Megatron defers) the accumulated sum is launched by the first,
    and the last backward returns what remains through the second (both are waited for together)."""

    def __init__(self, defer: Callable[[], bool], send: Callable[[torch.Tensor], torch.Tensor],
                 launch: Launch | None = None, asynchronous: Callable[[], bool] | None = None,
                 early: tuple[Launch, Launch] | None = None, split_at: Callable[[], int | None] | None = None) -> None:
        self.defer, self.send, self.launch = defer, send, launch
        self.asynchronous = asynchronous or (lambda: False)
        self.early, self.split_at = early, split_at or (lambda: None)
        self.acc: torch.Tensor | None = None
        self.pending: Callable[[], torch.Tensor] | None = None
        self.pending_early: Callable[[], torch.Tensor] | None = None
        self.deferred = 0  # backward passes deferred in this iteration

    @property
    def owes(self) -> bool:
        return self.acc is not None or self.pending is not None or self.pending_early is not None

    def __call__(self, grad: torch.Tensor) -> torch.Tensor | None:
        """The gradient for the owners' parameters now, or None while deferring or in flight."""
        if self.defer():
            wide = grad.to(torch.promote_types(grad.dtype, torch.float32))
            self.acc = wide.clone() if self.acc is None else self.acc.add_(wide)
            self.deferred += 1
            if self.early is not None and self.pending_early is None and self.deferred == self.split_at():
                self.pending_early, self.acc = self.early[0](self.acc), None
            return None
        if self.early is not None and self.pending_early is None and self.deferred and self.split_at() is not None:
            # the domain's other ranks launched their early part: a different payload would mismatch
            # (a schedule that deferred nothing, as a direct call, defers nothing on any rank: one return)
            raise RuntimeError(f"borrowed gradient return: {self.deferred} deferred backward passes before the last, "
                               f"expected {self.split_at()} (micro-batches - 1); the early return needs one backward "
                               "through the borrowed copies per micro-batch")
        self.deferred = 0
        if self.acc is not None:
            grad, self.acc = self.acc.add_(grad), None
        if self.pending_early is not None:
            finish = self._rest(grad)
            if self.launch is not None and self.asynchronous():
                assert self.pending is None, "a borrowed gradient return is already in flight"
                self.pending = finish
                return None
            return finish()
        if self.launch is not None and self.asynchronous():
            assert self.pending is None, "a borrowed gradient return is already in flight"
            self.pending = self.launch(grad)
            return None
        return self.send(grad)

    def _rest(self, grad: torch.Tensor | None) -> Callable[[], torch.Tensor]:
        """Launch what remains after the early part (if anything) and join the two returns."""
        assert self.early is not None and self.pending_early is not None
        first, self.pending_early = self.pending_early, None
        second = self.early[1](grad) if grad is not None else None

        def finish() -> torch.Tensor:
            out = first()
            return out if second is None else out.add_(second())

        return finish

    def flush(self) -> torch.Tensor | None:
        """What is still owed, returned now (collective over the group: every rank calls it)."""
        self.deferred = 0
        if self.pending is not None:
            finish, self.pending = self.pending, None
            return finish()
        grad, self.acc = self.acc, None
        if self.pending_early is not None:
            return self._rest(grad)()
        return None if grad is None else self.send(grad)

    def forget(self) -> None:
        self.acc = self.pending = self.pending_early = None
        self.deferred = 0


class _Views(torch.autograd.Function):
    """flat -> views of consecutive slices; backward: one flat gradient. Autograd's own slicing would
    give every view a zero-filled gradient of the whole buffer and add them all (a domain's 16
    expert tensors: 16 fills and adds of the buffer per backward, ~20% of a CPU rank's time)."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, spans: tuple[tuple[int, torch.Size], ...]) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
        ctx.set_materialize_grads(False)
        ctx.spans, ctx.numel = spans, flat.numel()
        ctx.gaps, end = [], 0  # what no view covers (a domain's own chunk): zeroed, the rest written once
        for start, shape in sorted(spans):
            if start > end:
                ctx.gaps.append((end, start))
            end = max(end, start + shape.numel())
        if end < ctx.numel:
            ctx.gaps.append((end, ctx.numel))
        return tuple(flat[start:start + shape.numel()].view(shape) for start, shape in spans)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # noqa: ANN001, ANN205
        present = [g for g in grads if g is not None]
        if not present:
            return None, None
        out = present[0].new_empty(ctx.numel)
        for start, end in ctx.gaps:
            out[start:end].zero_()
        for (start, shape), g in zip(ctx.spans, grads, strict=True):
            span = out[start:start + shape.numel()]
            span.zero_() if g is None else span.view(shape).copy_(g)
        return out, None


def views_of(flat: torch.Tensor, spans: Sequence[tuple[int, torch.Size]]) -> tuple[torch.Tensor, ...]:
    """Views of ``flat`` at (start, shape) spans (non-overlapping), differentiable as one node."""
    return _Views.apply(flat, tuple((int(start), torch.Size(shape)) for start, shape in spans))


def split_like(flat: torch.Tensor | None, params: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """A flat gradient as one tensor per parameter (in the parameters' dtype), or all None."""
    if flat is None:
        return (None,) * len(params)
    out, offset = [], 0
    for p in params:
        out.append(flat[offset:offset + p.numel()].view_as(p).to(p.dtype))
        offset += p.numel()
    return tuple(out)


def add_to_grads(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """Add a returned gradient outside autograd: into Megatron's main_grad when the parameter has
    one (DDP's buffer, before its reduction), else into .grad."""
    for p, g in zip(params, split_like(flat, params), strict=True):
        target = getattr(p, "main_grad", None)
        if target is not None:
            target.add_(g.to(target.dtype))
        elif p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.add_(g)


class FusedWgrad:
    """Megatron's --gradient-accumulation-fusion for borrowed copies. Its fused linear layers add a
    weight's gradient into ``weight.main_grad`` and give autograd none, so each copy gets a slice of
    this buffer (in the owners' main_grad dtype) as its main_grad, and the copies' backward takes
    the buffer's sum. What owners are owed goes into their main_grad directly: once the fused path
    set ``grad_added_to_main_grad``, Megatron's DDP hook no longer reads ``param.grad``."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.buffer: torch.Tensor | None = None

    def attach(self, flat: torch.Tensor, views: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> None:
        """Give every view of ``flat`` (the copies) the matching slice of the buffer as main_grad
        (callers skip it, and building the views' list, when not ``enabled``)."""
        if self.buffer is None or self.buffer.numel() != flat.numel() or self.buffer.device != flat.device:
            main = getattr(params[0], "main_grad", None)
            dtype = main.dtype if main is not None else torch.promote_types(flat.dtype, torch.float32)
            self.buffer = torch.zeros(flat.numel(), dtype=dtype, device=flat.device)
        base, size = flat.data_ptr(), flat.element_size()
        for v in views:
            start = (v.data_ptr() - base) // size
            v.main_grad = self.buffer[start:start + v.numel()].view_as(v)

    def take(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The copies' whole gradient: what autograd brought plus what the fused layers accumulated."""
        if not self.enabled or self.buffer is None:
            return grad
        total = self.buffer.clone() if grad is None else self.buffer.add(grad)
        self.buffer.zero_()
        return total

    def to_params(self, owed: torch.Tensor | None, params: Sequence[torch.Tensor]
                  ) -> tuple[torch.Tensor | None, ...]:
        """The owners' gradients for autograd (None with fusion: added to main_grad here)."""
        if owed is None or not self.enabled:
            return split_like(owed, params)
        add_to_grads(owed, params)
        return (None,) * len(params)
