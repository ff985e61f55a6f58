"""Top-k compression with error feedback for the gradients of borrowed experts: nothing is lost,
only delayed. Payloads use the weight codec's wire format (runtime/weight_codec.py)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from megatron_hybridep.kernels.codec import Backend
from megatron_hybridep.runtime.weight_codec import PayloadLayout, RatioOf, decode_into, encode, plan_layout


class ErrorFeedbackTopK:
    """Top-k gradient compression with error feedback, one residual per key (tensor).

    compress(key, g): acc += g; send top-k(acc); acc -= what was sent (after value-dtype
    rounding). So sum(sent over steps) = sum(g over steps) - acc: nothing is lost, only
    delayed, and ||acc|| stays bounded. Memory: one float32 accumulator per compressed tensor
    (4 bytes x numel). Ratio 1 (the default, "off") sends the gradient dense: exact, no state.
    Configured separately from the weight codec.
    """

    def __init__(
        self,
        ratio: float = 1.0,
        *,
        value_dtype: torch.dtype | None = None,
        ratio_of: RatioOf = "elements",
        backend: Backend = "auto",
    ) -> None:
        self.ratio = float(ratio)
        self.value_dtype = value_dtype
        self.ratio_of: RatioOf = ratio_of
        self.backend: Backend = backend
        self._acc: dict[Hashable, torch.Tensor] = {}

    def layout(self, numel: int, grad_dtype: torch.dtype, ratio: float | None = None) -> PayloadLayout:
        """A sparse payload's values in ``value_dtype`` (their rounding is fed back); a dense one
        (ratio 1, or sparse not smaller) is the gradient itself, exact: no feedback covers it.
        ``ratio``: a payload's own (default: ``self.ratio``)."""
        lay = plan_layout(numel, self.ratio if ratio is None else ratio, self.value_dtype or grad_dtype,
                          ratio_of=self.ratio_of)
        return plan_layout(numel, 1.0, grad_dtype) if lay.dense else lay

    def nbytes(self, numel: int, grad_dtype: torch.dtype) -> int:
        return self.layout(numel, grad_dtype).nbytes

    def compress(self, key: Hashable, grad: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        lay = self.layout(grad.numel(), grad.dtype)
        if lay.dense:
            return encode(grad, None, lay, out=out, backend=self.backend)
        acc = self._acc.get(key)
        if acc is None:
            acc = self._acc[key] = torch.zeros(grad.numel(), dtype=torch.float32, device=grad.device)
        elif acc.numel() != grad.numel():
            raise ValueError(f"key {key!r} held {acc.numel()} elements, now {grad.numel()}")
        acc.add_(grad.reshape(-1))
        payload = encode(acc, None, lay, out=out, backend=self.backend)
        # Error feedback: remove exactly what the receiver will add (rounded values included).
        decode_into(payload, lay, acc, acc, alpha=-1.0, backend=self.backend)
        return payload

    def decompress(
        self,
        payload: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        src_dtype: torch.dtype | None = None,
        accumulate: bool = False,
        ratio: float | None = None,
    ) -> torch.Tensor:
        """Dense gradient from a payload; ``accumulate=True`` adds it into ``out`` (the owner's
        gradient buffer) instead of overwriting. ``src_dtype``: the sender's gradient dtype
        (default: the output dtype; matters only without an explicit value_dtype). ``ratio``: the
        payload's, when ``self.ratio`` has moved on since it was compressed."""
        if out is None:
            if shape is None or dtype is None:
                raise ValueError("give out, or shape and dtype")
            out = torch.empty(shape, dtype=dtype, device=payload.device)
            accumulate = False
        lay = self.layout(out.numel(), src_dtype or out.dtype, ratio)
        return decode_into(payload, lay, out if accumulate else None, out, backend=self.backend)

    def residual(self, key: Hashable) -> torch.Tensor | None:
        """The error-feedback accumulator of ``key`` (float32, flat), None if none yet."""
        return self._acc.get(key)

    def reset(self, key: Hashable | None = None) -> None:
        if key is None:
            self._acc.clear()
        else:
            self._acc.pop(key, None)

    def state_dict(self) -> dict[Hashable, torch.Tensor]:
        """Accumulators to checkpoint (dropping them loses the delayed gradient mass)."""
        return dict(self._acc)

    def load_state_dict(self, state: dict[Hashable, torch.Tensor]) -> None:
        self._acc = {k: v.detach().clone().float().reshape(-1) for k, v in state.items()}

    @property
    def state_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._acc.values())
