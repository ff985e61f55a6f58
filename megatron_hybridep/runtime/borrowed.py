"""What borrowed expert weights owe their owners, shared by the domain gather and hot replicas.

Borrowed copies belong to the owners' parameters as they were when gathered: ``version_key`` reads
the parameters' in-place version counters, which every optimizer step bumps (Megatron's optimizers
write parameters in place), so a copy or an in-flight gather from before a step is never used after
it, even by a caller that does not tell the runtime about its steps.

The gradient computed with a copy is owed to its owner. While the runtime defers (the
micro-batches Megatron runs under ``no_sync``), it accumulates here, in at least fp32 like
Megatron's main grads; the first backward outside ``no_sync`` (the iteration's last micro-batch)
returns the sum once, launched asynchronously when the loop collects it before Megatron's gradient
reduction (grad_sync.py). Nothing owed may survive to the optimizer step (``owes``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def version_key(params: Sequence[torch.Tensor], step: int = 0) -> tuple[int, ...]:
    """The runtime's optimizer-step count (after_optimizer_step) and the parameters' versions: either
    moving makes a copy stale (a loop that does not report steps, an optimizer writing ``.data``)."""
    return (step, *(p._version for p in params))


class OwedGradient:
    """Accumulates a borrowed copy's gradient while ``defer()``; otherwise returns the total to the
    owners: through autograd (``send``, blocking), or, when ``asynchronous()``, launched now
    (``launch`` -> a function that waits and gives the owners' gradient) and collected by ``flush``
    before Megatron reduces gradients, so the return overlaps the rest of the backward pass."""

    def __init__(self, defer: Callable[[], bool], send: Callable[[torch.Tensor], torch.Tensor],
                 launch: Callable[[torch.Tensor], Callable[[], torch.Tensor]] | None = None,
                 asynchronous: Callable[[], bool] | None = None) -> None:
        self.defer, self.send, self.launch = defer, send, launch
        self.asynchronous = asynchronous or (lambda: False)
        self.acc: torch.Tensor | None = None
        self.pending: Callable[[], torch.Tensor] | None = None

    @property
    def owes(self) -> bool:
        return self.acc is not None or self.pending is not None

    def __call__(self, grad: torch.Tensor) -> torch.Tensor | None:
        """The gradient for the owners' parameters now, or None while deferring or in flight."""
        if self.defer():
            wide = grad.to(torch.promote_types(grad.dtype, torch.float32))
            self.acc = wide.clone() if self.acc is None else self.acc.add_(wide)
            return None
        if self.acc is not None:
            grad, self.acc = self.acc.add_(grad), None
        if self.launch is not None and self.asynchronous():
            assert self.pending is None, "a borrowed gradient return is already in flight"
            self.pending = self.launch(grad)
            return None
        return self.send(grad)

    def flush(self) -> torch.Tensor | None:
        """What is still owed, returned now (collective over the group: every rank calls it)."""
        if self.pending is not None:
            finish, self.pending = self.pending, None
            return finish()
        if self.acc is None:
            return None
        grad, self.acc = self.acc, None
        return self.send(grad)

    def forget(self) -> None:
        self.acc = self.pending = None


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
