"""The expert-weight codec (the paper's section 4): top-k of (weight - shared expert), packed into
one flat uint8 payload laid out by plan/wire.py (the wire format's one definition; the planner
sizes payloads from the same module). Pure torch; no torch.distributed.

Why block-local offsets: entry i's absolute index is block_base + offset, the block being found
from the per-block counts (entries are stored in index order). At the ratios that matter
(10x-100x) BLOCK8 costs k + n/128 bytes of index, vs 4k for int32 indices: at 50x that is
1.39 bytes per kept entry instead of 4 (the entropy of a random 1-in-50 subset is ~0.88 bytes
per entry, so little is left on the table), and decoding stays fully parallel (one 256-element
tile per program, no prefix scan over the whole tensor). Below ratio ~8.5 a bitmap (n/8 bytes,
IndexScheme.BITMAP) is smaller: the default returned gradients at 4x use it (torch ops only).

Ratios: ``ratio`` is an element ratio by default: k = max(1, floor(numel / ratio)), the kept
fraction being 1/ratio. The byte ratio (dense bytes / payload bytes) is lower because indices cost
bytes: see :attr:`PayloadLayout.byte_ratio`. ``ratio_of="bytes"`` instead picks the largest k
whose payload fits in dense_bytes / ratio. Ratio <= 1, or any ratio where the sparse payload would
not be smaller than the dense one, sends the dense tensor: exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from megatron_hybridep.kernels.codec import (
    COUNT_DTYPES,
    OFFSET_DTYPES,
    VALUE_DTYPES,
    Backend,
    offsets_per_entry,
    residual_topk_encode,
    residual_topk_encode_rows,
    sparse_residual_decode,
)
from megatron_hybridep.plan import wire
from megatron_hybridep.plan.wire import ALIGN, IndexScheme, RatioOf, k_for_ratio

# the kernels' index dtypes must be the sizes the wire format counts (and the planner prices)
for _s, _b in wire.INDEX_BYTES.items():
    _bits = _s.block_bits
    if (OFFSET_DTYPES[_bits].itemsize * offsets_per_entry(_bits), COUNT_DTYPES[_bits].itemsize) != _b:
        raise ImportError(f"kernels/codec.py index dtypes for {_s.name} disagree with plan/wire.py INDEX_BYTES; "
                          "fix: change both together")


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _from_wire(name: str, doc: str | None = None) -> property:
    """A PayloadLayout property that reads its WireLayout's ``name``."""
    return property(lambda self: getattr(self.wire_layout, name), doc=doc)


@dataclass(frozen=True)
class PayloadLayout:
    """Where everything sits in one encoded tensor's payload (plan/wire.py WireLayout with the
    value dtype and the index dtypes the kernels use). Identical on every rank."""

    numel: int
    k: int  # kept entries (== numel for DENSE)
    value_dtype: torch.dtype
    scheme: IndexScheme

    @cached_property
    def wire_layout(self) -> wire.WireLayout:
        return wire.WireLayout(self.numel, self.k, _itemsize(self.value_dtype), self.scheme)

    @property
    def dense(self) -> bool:
        return self.scheme is IndexScheme.DENSE

    @property
    def offset_dtype(self) -> torch.dtype | None:
        return None if self.dense else OFFSET_DTYPES[self.scheme.block_bits]

    @property
    def count_dtype(self) -> torch.dtype | None:
        return None if self.dense else COUNT_DTYPES[self.scheme.block_bits]

    # the wire layout's sizes and offsets, read through
    nblocks = _from_wire("nblocks")
    noffsets = _from_wire("noffsets")
    values_at = _from_wire("values_at")
    counts_at = _from_wire("counts_at")
    offsets_at = _from_wire("offsets_at")
    nbytes = _from_wire("nbytes", "Bytes on the wire for this tensor, index bytes and alignment padding included.")
    element_ratio = _from_wire("element_ratio")
    byte_ratio = _from_wire("byte_ratio", "Dense bytes in the value dtype / payload bytes.")


def plan_layout(
    numel: int, ratio: float, value_dtype: torch.dtype, *, ratio_of: RatioOf = "elements"
) -> PayloadLayout:
    """The payload layout for one tensor of ``numel`` elements at ``ratio`` (plan/wire.py)."""
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")
    if numel >= 2**31:
        raise ValueError("tensors of 2**31 elements or more are not supported; split them")
    if value_dtype not in VALUE_DTYPES:
        raise ValueError(f"value_dtype must be one of {VALUE_DTYPES}, got {value_dtype}")
    w = wire.choose_layout(numel, ratio, _itemsize(value_dtype), ratio_of=ratio_of)
    return PayloadLayout(w.numel, w.k, value_dtype, w.scheme)


def encoded_nbytes(
    numel: int, ratio: float, value_dtype: torch.dtype, *, ratio_of: RatioOf = "elements"
) -> int:
    """Exact payload bytes of one tensor: what the planner should use as expert bytes."""
    return plan_layout(numel, ratio, value_dtype, ratio_of=ratio_of).nbytes


@dataclass
class Sections:
    """Typed views into a payload. ``dense`` for DENSE layouts, else values/offsets/counts."""

    dense: torch.Tensor | None = None
    values: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    counts: torch.Tensor | None = None


def unpack(payload: torch.Tensor, layout: PayloadLayout) -> Sections:
    """Views (no copies) of the sections of ``payload`` (flat uint8 of layout.nbytes)."""
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != layout.nbytes:
        raise ValueError(f"payload must be flat uint8 of {layout.nbytes} bytes, "
                         f"got {tuple(payload.shape)} {payload.dtype}")
    if payload.storage_offset() % ALIGN:
        # Typed views need aligned storage; all-gather slices of aligned payloads stay aligned.
        raise ValueError("payload must start at a 16-byte-aligned storage offset")

    def view(at: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        return payload[at: at + count * _itemsize(dtype)].view(dtype)

    if layout.dense:
        return Sections(dense=view(0, layout.numel, layout.value_dtype))
    return Sections(
        values=view(layout.values_at, layout.k, layout.value_dtype),
        counts=view(layout.counts_at, layout.nblocks, layout.count_dtype),
        offsets=view(layout.offsets_at, layout.noffsets, layout.offset_dtype),
    )


def _zero_padding(payload: torch.Tensor, layout: PayloadLayout) -> None:
    # Deterministic payload bytes (padding would otherwise be uninitialised memory).
    # payload: one slot [nbytes], or [E, nbytes] (every slot's padding in one launch per gap).
    isz = _itemsize(layout.value_dtype)
    if layout.dense:
        payload[..., layout.numel * isz:].zero_()
        return
    payload[..., layout.k * isz: layout.counts_at].zero_()
    payload[..., layout.counts_at + layout.nblocks * _itemsize(layout.count_dtype): layout.offsets_at].zero_()
    payload[..., layout.offsets_at + layout.noffsets * _itemsize(layout.offset_dtype):].zero_()


def _row_sections(payloads: torch.Tensor, layout: PayloadLayout) -> Sections:
    """Views of every slot's sparse sections in a [E, nbytes] payload buffer: [E, k] values and
    offsets, [E, nblocks] counts (strided rows, contiguous columns)."""

    def cols(at: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        return payloads[:, at:at + count * _itemsize(dtype)].view(dtype)

    return Sections(values=cols(layout.values_at, layout.k, layout.value_dtype),
                    offsets=cols(layout.offsets_at, layout.noffsets, layout.offset_dtype),
                    counts=cols(layout.counts_at, layout.nblocks, layout.count_dtype))


def pack(sections: Sections, layout: PayloadLayout, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy separately held sections into one payload (inverse of :func:`unpack`)."""
    dev = (sections.dense if layout.dense else sections.values).device
    payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=dev) if out is None else out
    views = unpack(payload, layout)
    if layout.dense:
        views.dense.copy_(sections.dense.reshape(-1))
    else:
        views.values.copy_(sections.values)
        views.offsets.copy_(sections.offsets)
        views.counts.copy_(sections.counts)
    _zero_padding(payload, layout)
    return payload


def encode(
    weight: torch.Tensor,
    shared: torch.Tensor | None,
    layout: PayloadLayout,
    *,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
    first_hist: torch.Tensor | None = None,
) -> torch.Tensor:
    """Encode ``weight`` against ``shared`` (None = zeros) into a flat uint8 payload.

    ``out`` (flat uint8, layout.nbytes) lets callers encode straight into their slot of an
    all-gather buffer. DENSE layouts ignore ``shared`` and copy the weight. ``first_hist``: the
    radix select's first histogram, counted by a fused optimizer step (kernels/fused_codec.py).
    """
    if weight.numel() != layout.numel:
        raise ValueError(f"weight has {weight.numel()} elements, layout expects {layout.numel}")
    payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=weight.device) if out is None else out
    views = unpack(payload, layout)
    if layout.dense:
        views.dense.copy_(weight.reshape(-1))
    else:
        residual_topk_encode(weight.contiguous(), None if shared is None else shared.contiguous(), layout.k,
                             layout.scheme.block_bits, views.values, views.offsets, views.counts,
                             backend=backend, first_hist=first_hist)
    _zero_padding(payload, layout)
    return payload


def decode_into(
    payload: torch.Tensor,
    layout: PayloadLayout,
    base: torch.Tensor | None,
    out: torch.Tensor,
    *,
    alpha: float = 1.0,
    backend: Backend = "auto",
) -> torch.Tensor:
    """out = base + alpha * (encoded tensor), base None = zeros, base may alias out.

    For sparse layouts the encoded tensor is the sparse residual; for DENSE it is the dense
    tensor. Weight decoding uses :func:`decode`; this is the general form (gradient accumulation).
    """
    if out.numel() != layout.numel:
        raise ValueError(f"out has {out.numel()} elements, layout expects {layout.numel}")
    if out.dtype not in VALUE_DTYPES:
        raise ValueError(f"out dtype must be one of {VALUE_DTYPES}, got {out.dtype}")
    views = unpack(payload, layout)
    if layout.dense:
        dense = views.dense.view(out.shape)
        if base is None and alpha == 1.0:
            return out.copy_(dense)
        acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device) if base is None else base.float()
        return out.copy_(acc.add_(dense.float(), alpha=alpha))
    base_flat = None if base is None else base.reshape(-1)
    sparse_residual_decode(base_flat, views.values, views.offsets, views.counts, layout.scheme.block_bits,
                           out.view(-1), alpha, backend=backend)
    return out


def decode(
    payload: torch.Tensor,
    layout: PayloadLayout,
    shared: torch.Tensor | None,
    *,
    out: torch.Tensor | None = None,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Rebuild a weight: the dense tensor (DENSE) or shared + sparse residual (None = zeros).

    The result goes to ``out`` if given, else to a new tensor of ``shape``/``dtype`` (defaulting
    to shared's, then to (numel,) / the value dtype).
    """
    if out is None:
        if shape is None:
            shape = shared.shape if shared is not None else (layout.numel,)
        if dtype is None:
            dtype = shared.dtype if shared is not None else layout.value_dtype
        out = torch.empty(shape, dtype=dtype, device=payload.device)
    return decode_into(payload, layout, None if layout.dense else shared, out, backend=backend)


class SharedResidualCodec:
    """Expert-weight codec: top-k of (weight - shared) at a configurable ratio.

    ``value_dtype`` None sends values in the weight's dtype (then ratio 1 is bit exact).
    ``use_shared=False`` ignores ``shared`` and sends top-k of the weight (ablation).
    Owners always compute with their exact weights; only decoded (borrowed) copies approximate.
    """

    def __init__(
        self,
        ratio: float = 1.0,
        *,
        value_dtype: torch.dtype | None = None,
        use_shared: bool = True,
        ratio_of: RatioOf = "elements",
        backend: Backend = "auto",
    ) -> None:
        if ratio_of not in ("elements", "bytes"):
            raise ValueError(f"ratio_of must be 'elements' or 'bytes', got {ratio_of!r}")
        self.ratio = float(ratio)
        self.value_dtype = value_dtype
        self.use_shared = use_shared
        self.ratio_of: RatioOf = ratio_of
        self.backend: Backend = backend

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(ratio={self.ratio}, value_dtype={self.value_dtype}, "
                f"use_shared={self.use_shared}, ratio_of={self.ratio_of!r})")

    def layout(self, numel: int, weight_dtype: torch.dtype) -> PayloadLayout:
        return plan_layout(numel, self.ratio, self.value_dtype or weight_dtype, ratio_of=self.ratio_of)

    def nbytes(self, numel: int, weight_dtype: torch.dtype) -> int:
        """Payload bytes for one tensor of this size: use this as the planner's expert bytes."""
        return self.layout(numel, weight_dtype).nbytes

    def encode(self, weight: torch.Tensor, shared: torch.Tensor | None = None, *,
               out: torch.Tensor | None = None, first_hist: torch.Tensor | None = None) -> torch.Tensor:
        lay = self.layout(weight.numel(), weight.dtype)
        if self.use_shared and shared is None and not lay.dense:
            raise ValueError("this codec needs the shared expert (or construct it with use_shared=False)")
        return encode(weight, shared if self.use_shared else None, lay, out=out, backend=self.backend,
                      first_hist=first_hist)

    def decode(self, payload: torch.Tensor, shared: torch.Tensor | None = None, *,
               out: torch.Tensor | None = None, shape: Sequence[int] | None = None,
               dtype: torch.dtype | None = None, src_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rebuild into ``out``, or a new tensor shaped like ``shared`` (or ``shape``/``dtype``).

        ``src_dtype`` is the sender's weight dtype; it defaults to the output dtype and only
        matters when the codec has no explicit value_dtype (the layout depends on it).
        """
        if out is not None:
            numel, dtype = out.numel(), out.dtype
        elif shape is not None:
            numel = math.prod(shape)
        elif shared is not None:
            numel, shape = shared.numel(), shared.shape
        else:
            raise ValueError("give out, shared or shape")
        dtype = dtype or (shared.dtype if shared is not None else self.value_dtype)
        if dtype is None:
            raise ValueError("give out, shared or dtype")
        lay = self.layout(numel, src_dtype or dtype)
        if self.use_shared and shared is None and not lay.dense:
            raise ValueError("this codec needs the shared expert to decode")
        return decode(payload, lay, shared if self.use_shared else None, out=out, shape=shape,
                      dtype=dtype, backend=self.backend)


    def encode_batch(self, weights: torch.Tensor | Sequence[torch.Tensor], shared: torch.Tensor | None = None,
                     *, out: torch.Tensor | None = None, first_hists: torch.Tensor | None = None) -> torch.Tensor:
        """Encode E same-shaped experts into one flat uint8 buffer of E slots of ``nbytes`` each
        (slot e = expert e; slots stay 16-byte aligned), e.g. the input of a domain all-gather.
        ``weights``: a [E, ...] tensor (such as a view of a rank's flat expert buffer) or a list.
        ``shared``: one tensor for all experts, or one per expert ([E, ...], e.g. each peer's copy).
        ``first_hists``: [E, 256] int32 from kernels.fused_codec.adamw_step_hist (the optimizer step
        fused with the encode's first pass; it must have used the same base as ``shared``).
        Every expert is encoded in one set of kernel launches (kernels.codec.residual_topk_encode_rows);
        each slot holds the bytes :meth:`encode` gives that expert.

        Args:
            weights: [E, ...] float32 / bfloat16 / float16 (or a list of E same-sized tensors).
            shared: [...] (one base for all) or [E, ...] (one per expert), the weights' dtype; None
                only for DENSE layouts or a codec built with use_shared=False.
            out: uint8 of E * nbytes elements to write into (e.g. an all-gather's input slot).
            first_hists: int32 [E, 256] or None.

        Returns:
            uint8 [E * nbytes] (``out`` when given).
        """
        if not isinstance(weights, torch.Tensor):
            if not weights:
                raise ValueError("no experts to encode")
            weights = torch.stack([w.reshape(weights[0].shape) for w in weights])
        if weights.shape[0] == 0:
            raise ValueError("no experts to encode")
        e_count, n = weights.shape[0], weights[0].numel()
        lay = self.layout(n, weights.dtype)
        buf = torch.empty(e_count * lay.nbytes, dtype=torch.uint8, device=weights.device) if out is None else out
        if buf.numel() != e_count * lay.nbytes:
            raise ValueError(f"out has {buf.numel()} bytes, {e_count} experts need {e_count * lay.nbytes}")
        p2 = buf.view(e_count, lay.nbytes)
        rows = weights.reshape(e_count, n)
        if lay.dense:
            p2[:, :n * _itemsize(lay.value_dtype)].view(lay.value_dtype).copy_(rows)
        else:
            if not self.use_shared:
                shared = None
            elif shared is None:
                raise ValueError("this codec needs the shared expert (or construct it with use_shared=False)")
            else:
                shared = shared.reshape(-1) if shared.dim() == weights.dim() - 1 else shared.reshape(e_count, n)
            sec = _row_sections(p2, lay)
            residual_topk_encode_rows(rows, shared, lay.k, lay.scheme.block_bits, sec.values, sec.offsets,
                                      sec.counts, backend=self.backend, first_hists=first_hists)
        _zero_padding(p2, lay)
        return buf

    def decode_batch(self, payloads: torch.Tensor, shared: torch.Tensor | None = None, *,
                     out: torch.Tensor, src_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Decode a buffer of E slots (as made by :meth:`encode_batch`, or an all-gather output)
        into ``out`` of shape [E, ...]. Returns out."""
        flat = payloads.reshape(-1)
        e_count = out.shape[0]
        nb = self.nbytes(out[0].numel(), src_dtype or out.dtype)
        if flat.numel() != e_count * nb:
            raise ValueError(f"payloads have {flat.numel()} bytes, {e_count} experts need {e_count * nb}")
        for e in range(e_count):
            self.decode(flat[e * nb:(e + 1) * nb], _per_expert(shared, e, out[e]), out=out[e], src_dtype=src_dtype)
        return out

    def decode_rows(self, payloads: torch.Tensor, base: torch.Tensor, *, out: torch.Tensor,
                    shift: torch.Tensor | None = None) -> torch.Tensor:
        """Fused form of ``decode_batch(payloads, base + shift, out=out)`` for R rows (a layer's
        borrowed experts, all peers): one kernel launch, one pass over base, no rebased copy.
        base, out: [R, n] (base may be out); shift: [n] in base's dtype (the shared expert's
        change since the copies were built) or None. Bit-equal to the unfused path (tested)."""
        from megatron_hybridep.kernels.fused_codec import decode_rows

        rows = out.shape[0]
        lay = self.layout(out[0].numel(), out.dtype)
        flat = payloads.reshape(-1)
        if flat.numel() != rows * lay.nbytes:
            raise ValueError(f"payloads have {flat.numel()} bytes, {rows} rows need {rows * lay.nbytes}")
        if lay.dense or not self.use_shared:
            b = base if shift is None else base + shift.reshape(1, -1)
            return self.decode_batch(payloads, b if self.use_shared else None, out=out)
        sec = _row_sections(flat.view(rows, lay.nbytes), lay)
        return decode_rows(base.reshape(rows, -1), sec.values, sec.offsets, sec.counts, lay.scheme.block_bits,
                           out.view(rows, -1), shift=shift, backend=self.backend)


def _per_expert(shared: torch.Tensor | None, e: int, like: torch.Tensor) -> torch.Tensor | None:
    """Expert e's base: ``shared`` itself, or its row e when there is one base per expert."""
    if shared is None or shared.dim() == like.dim():
        return shared
    return shared[e]


class TopKCodec(SharedResidualCodec):
    """Plain top-k of the weight itself (shared = 0): the ablation baseline."""

    def __init__(self, ratio: float = 1.0, *, value_dtype: torch.dtype | None = None,
                 ratio_of: RatioOf = "elements", backend: Backend = "auto") -> None:
        super().__init__(ratio, value_dtype=value_dtype, use_shared=False, ratio_of=ratio_of, backend=backend)


__all__ = ["ALIGN", "IndexScheme", "PayloadLayout", "RatioOf", "Sections", "SharedResidualCodec", "TopKCodec",
           "decode", "decode_into", "encode", "encoded_nbytes", "k_for_ratio", "pack", "plan_layout", "unpack"]
