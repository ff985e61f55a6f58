"""Compression codecs for parameter-efficient expert migration (PAPER.md section 4).

Three pieces, all pure torch (no torch.distributed: communication is passed in as callbacks):

* :class:`SharedResidualCodec` ships an expert as top-k(expert - shared) and rebuilds it as
  shared + residual; ``use_shared=False`` (or :class:`TopKCodec`) is plain top-k, the ablation.
* :func:`shared_expert_mean` / :class:`SharedExpertRule` define the shared expert and when it
  is refreshed.
* :class:`ErrorFeedbackTopK` compresses gradients of borrowed experts with error feedback.

Wire format
-----------
An encoded tensor is one flat uint8 payload whose size depends only on (numel, ratio, value
dtype), so every rank can size all-gather buffers without talking, and the planner gets real
byte counts from :func:`encoded_nbytes`. Sections, each starting at a 16-byte boundary (so
payloads can be concatenated in one all-gather buffer and still viewed as typed tensors):

    DENSE:  [weight in value dtype]                            (ratio 1, or when sparse would not be smaller)
    sparse: [values: k x value dtype][counts: nblocks x count dtype][offsets: k x offset dtype]

Index encodings (the cheapest for (numel, k) is chosen; padding is counted):

    scheme   block     offset   count   index bytes
    BLOCK8   2**8      uint8    uint16  k + 2*ceil(n/256)      cheapest for element ratio < 128
    BLOCK16  2**16     uint16   int32   2k + 4*ceil(n/65536)   ratio 128 .. ~32768
    FLAT32   1 block   int32    int32   4k + 4                 only for absurd ratios

Why block-local offsets: entry i's absolute index is block_base + offset, the block being found
from the per-block counts (entries are stored in index order). At the ratios that matter
(10x-100x) BLOCK8 costs k + n/128 bytes of index, vs 4k for int32 indices: at 50x that is
1.39 bytes per kept entry instead of 4 (the entropy of a random 1-in-50 subset is ~0.88 bytes
per entry, so little is left on the table), and decoding stays fully parallel (one 256-element
tile per program, no prefix scan over the whole tensor). A bitmap (n/8 bytes) would beat BLOCK8
only below ratio ~8.5; not implemented.

Ratios
------
``ratio`` is an element ratio by default: k = max(1, floor(numel / ratio)), the kept fraction
being 1/ratio. The byte ratio (dense bytes / payload bytes) is lower because indices cost bytes:
see :attr:`PayloadLayout.byte_ratio`. ``ratio_of="bytes"`` instead picks the largest k whose
payload fits in dense_bytes / ratio. Ratio <= 1, or any ratio where the sparse payload would not
be smaller than the dense one, sends the dense tensor: exact.

Use in the runtime (one MoE layer, E local experts of n parameters each, domain of S ranks)
-----------------------------------------------------------------------------------------
    codec = SharedResidualCodec(50)                      # planner: codec.nbytes(n, dtype) per expert
    shared = rule.maybe_refresh(step, shared, own, E_total, reduce_sum)   # after optimizer.step()
    send = codec.encode_batch(own.view(E, n), shared)    # [E * nbytes], owners keep exact weights
    all_gather_into_tensor(recv, send, group=domain)     # recv: [S * E * nbytes]
    codec.decode_batch(recv[peer slots], shared, out=borrowed.view(E, n))   # just before compute
    # backward, borrower side:  p = ef.compress((layer, expert), grad_of_borrowed_copy)
    # owner side:               ef.decompress(p, out=owner_grad, accumulate=True)
Memory: a payload buffer of S * E * nbytes per layer in flight; the error-feedback compressor
keeps one float32 accumulator per borrowed expert (4 bytes x n).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kernels.codec import (
    COUNT_DTYPES,
    OFFSET_DTYPES,
    VALUE_DTYPES,
    Backend,
    residual_topk_encode,
    sparse_residual_decode,
)

RatioOf = Literal["elements", "bytes"]
ALIGN = 16


class IndexScheme(enum.Enum):
    DENSE = 0
    BLOCK8 = 8
    BLOCK16 = 16
    FLAT32 = 32

    @property
    def block_bits(self) -> int:
        return self.value


def _align(x: int) -> int:
    return -(-x // ALIGN) * ALIGN


def _nblocks(numel: int, scheme: IndexScheme) -> int:
    return 1 if scheme is IndexScheme.FLAT32 else -(-numel // (1 << scheme.block_bits))


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


@dataclass(frozen=True)
class PayloadLayout:
    """Where everything sits in one encoded tensor's payload. Identical on every rank."""

    numel: int
    k: int  # kept entries (== numel for DENSE)
    value_dtype: torch.dtype
    scheme: IndexScheme

    @property
    def dense(self) -> bool:
        return self.scheme is IndexScheme.DENSE

    @property
    def nblocks(self) -> int:
        return 0 if self.dense else _nblocks(self.numel, self.scheme)

    @property
    def offset_dtype(self) -> torch.dtype | None:
        return None if self.dense else OFFSET_DTYPES[self.scheme.block_bits]

    @property
    def count_dtype(self) -> torch.dtype | None:
        return None if self.dense else COUNT_DTYPES[self.scheme.block_bits]

    @property
    def values_at(self) -> int:
        return 0

    @property
    def counts_at(self) -> int:
        return _align(self.k * _itemsize(self.value_dtype))

    @property
    def offsets_at(self) -> int:
        if self.dense:
            return self.counts_at
        return _align(self.counts_at + self.nblocks * _itemsize(self.count_dtype))

    @property
    def nbytes(self) -> int:
        """Bytes on the wire for this tensor, index bytes and alignment padding included."""
        if self.dense:
            return self.counts_at
        return _align(self.offsets_at + self.k * _itemsize(self.offset_dtype))

    @property
    def element_ratio(self) -> float:
        return self.numel / self.k

    @property
    def byte_ratio(self) -> float:
        """Dense bytes in the value dtype / payload bytes."""
        return self.numel * _itemsize(self.value_dtype) / self.nbytes


def k_for_ratio(numel: int, ratio: float) -> int:
    """Kept entries for an element ratio: max(1, floor(numel / ratio)); numel when ratio <= 1."""
    if ratio <= 1:
        return numel
    # The 1e-9 slack makes ratio = numel / k give back k despite float rounding.
    return max(1, min(numel, math.floor(numel / ratio * (1 + 1e-9))))


def _best_sparse(numel: int, k: int, value_dtype: torch.dtype) -> PayloadLayout:
    cands = [PayloadLayout(numel, k, value_dtype, s)
             for s in (IndexScheme.BLOCK8, IndexScheme.BLOCK16, IndexScheme.FLAT32)]
    return min(cands, key=lambda lay: lay.nbytes)  # stable: ties keep the smaller block


def plan_layout(
    numel: int, ratio: float, value_dtype: torch.dtype, *, ratio_of: RatioOf = "elements"
) -> PayloadLayout:
    """The payload layout for one tensor of ``numel`` elements at ``ratio`` (see module doc)."""
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")
    if numel >= 2**31:
        raise ValueError("tensors of 2**31 elements or more are not supported; split them")
    if value_dtype not in VALUE_DTYPES:
        raise ValueError(f"value_dtype must be one of {VALUE_DTYPES}, got {value_dtype}")
    dense = PayloadLayout(numel, numel, value_dtype, IndexScheme.DENSE)
    if ratio <= 1:
        return dense
    if ratio_of == "elements":
        best = _best_sparse(numel, k_for_ratio(numel, ratio), value_dtype)
    elif ratio_of == "bytes":
        budget = numel * _itemsize(value_dtype) / ratio
        best = None
        for scheme in (IndexScheme.BLOCK8, IndexScheme.BLOCK16, IndexScheme.FLAT32):
            per = _itemsize(value_dtype) + _itemsize(OFFSET_DTYPES[scheme.block_bits])
            fixed = _nblocks(numel, scheme) * _itemsize(COUNT_DTYPES[scheme.block_bits])
            k = max(1, min(numel, int((budget - fixed) // per)))
            while k > 1 and PayloadLayout(numel, k, value_dtype, scheme).nbytes > budget:
                k -= 1  # alignment padding; at most a few steps
            lay = PayloadLayout(numel, k, value_dtype, scheme)
            if best is None or (lay.k, -lay.nbytes) > (best.k, -best.nbytes):
                best = lay
    else:
        raise ValueError(f"ratio_of must be 'elements' or 'bytes', got {ratio_of!r}")
    return dense if best.nbytes >= dense.nbytes else best


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
        offsets=view(layout.offsets_at, layout.k, layout.offset_dtype),
    )


def _zero_padding(payload: torch.Tensor, layout: PayloadLayout) -> None:
    # Deterministic payload bytes (padding would otherwise be uninitialised memory).
    isz = _itemsize(layout.value_dtype)
    if layout.dense:
        payload[layout.numel * isz:].zero_()
        return
    payload[layout.k * isz: layout.counts_at].zero_()
    payload[layout.counts_at + layout.nblocks * _itemsize(layout.count_dtype): layout.offsets_at].zero_()
    payload[layout.offsets_at + layout.k * _itemsize(layout.offset_dtype):].zero_()


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
        fused with the encode's first pass; it must have used the same base as ``shared``)."""
        ws = list(weights.unbind(0)) if isinstance(weights, torch.Tensor) else list(weights)
        if not ws:
            raise ValueError("no experts to encode")
        nb = self.nbytes(ws[0].numel(), ws[0].dtype)
        buf = torch.empty(len(ws) * nb, dtype=torch.uint8, device=ws[0].device) if out is None else out.view(-1)
        if buf.numel() != len(ws) * nb:
            raise ValueError(f"out has {buf.numel()} bytes, {len(ws)} experts need {len(ws) * nb}")
        for e, w in enumerate(ws):
            self.encode(w, _per_expert(shared, e, w), out=buf[e * nb:(e + 1) * nb],
                        first_hist=None if first_hists is None else first_hists[e])
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
        from kernels.fused_codec import decode_rows

        rows = out.shape[0]
        lay = self.layout(out[0].numel(), out.dtype)
        flat = payloads.reshape(-1)
        if flat.numel() != rows * lay.nbytes:
            raise ValueError(f"payloads have {flat.numel()} bytes, {rows} rows need {rows * lay.nbytes}")
        if lay.dense or not self.use_shared:
            b = base if shift is None else base + shift.reshape(1, -1)
            return self.decode_batch(payloads, b if self.use_shared else None, out=out)
        p2 = flat.view(rows, lay.nbytes)

        def cols(at: int, count: int, dtype: torch.dtype) -> torch.Tensor:
            return p2[:, at:at + count * _itemsize(dtype)].view(dtype)

        return decode_rows(base.reshape(rows, -1), cols(lay.values_at, lay.k, lay.value_dtype),
                           cols(lay.offsets_at, lay.k, lay.offset_dtype),
                           cols(lay.counts_at, lay.nblocks, lay.count_dtype), lay.scheme.block_bits,
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


# --- shared expert -------------------------------------------------------------------------

ReduceSum = Callable[[torch.Tensor], torch.Tensor]


def shared_expert_mean(
    local_experts: Sequence[torch.Tensor],
    num_experts: int,
    reduce_sum: ReduceSum | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Mean of all ``num_experts`` experts of one MoE layer (one weight tensor of each).

    local_experts: the exact weights of the experts this rank *owns* (not borrowed copies).
    reduce_sum: sums a float32 tensor over the ranks that own the layer's experts, every
    expert being owned exactly once in that group (for example ``all_reduce(SUM)`` over the
    expert-parallel group of one expert-data-parallel replica). It must return bit-identical
    results on every rank, because encoder and decoder must use the same shared tensor
    (NCCL/gloo ring and tree all-reduce do; a reduce + broadcast also does). None = one process.
    Summation is in float32, in list order; the result is cast to ``dtype`` (default: the
    experts' dtype).
    """
    if not local_experts:
        raise ValueError("each rank needs at least one local expert (it defines shape and device)")
    acc = torch.zeros(local_experts[0].shape, dtype=torch.float32, device=local_experts[0].device)
    for w in local_experts:
        acc += w.float()
    if reduce_sum is not None:
        acc = reduce_sum(acc)
    return (acc / num_experts).to(dtype or local_experts[0].dtype)


@dataclass(frozen=True)
class SharedExpertRule:
    """When the shared expert is (re)computed as :func:`shared_expert_mean` of the exact experts.

    The rule (every rank applies it with the same step counter, so all ranks agree):
      * at start (and on resume, unless restored from the checkpoint): compute it;
      * then every ``refresh_every`` optimizer steps (0 = never: frozen after init);
      * the refresh happens after that step's optimizer update and before that step's encode,
        i.e. payloads are always encoded and decoded against the same shared tensor. Payloads
        in flight must be decoded before the swap (the migration queue drains every step).
    Cost: one dense all-reduce of one expert per layer per refresh. Why not every step (the
    paper): on a slow link a dense all-reduce costs ~2x an uncompressed expert, which would undo
    a 50x compression; refreshing every N steps amortises it to 2/N of an expert per step, and
    the residual only grows as fast as the experts drift from their mean.
    """

    refresh_every: int = 0

    def __post_init__(self) -> None:
        if self.refresh_every < 0:
            raise ValueError("refresh_every must be >= 0")

    def due(self, step: int, initialised: bool = True) -> bool:
        if not initialised:
            return True
        return self.refresh_every > 0 and step > 0 and step % self.refresh_every == 0

    def sync_bytes_per_step(self, numel: int, dtype: torch.dtype) -> float:
        """Average all-reduce payload per step and MoE layer for the planner (the all-reduce of
        one dense expert every ``refresh_every`` steps; 0 when frozen)."""
        if self.refresh_every == 0:
            return 0.0
        return numel * _itemsize(dtype) / self.refresh_every

    def maybe_refresh(
        self,
        step: int,
        shared: torch.Tensor | None,
        local_experts: Sequence[torch.Tensor],
        num_experts: int,
        reduce_sum: ReduceSum | None = None,
    ) -> torch.Tensor:
        """The shared tensor to use for ``step``: a new mean when due, else ``shared`` unchanged."""
        if self.due(step, initialised=shared is not None):
            dtype = shared.dtype if shared is not None else None
            return shared_expert_mean(local_experts, num_experts, reduce_sum, dtype=dtype)
        return shared


# --- gradient compression with error feedback ---------------------------------------------


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

    def layout(self, numel: int, grad_dtype: torch.dtype) -> PayloadLayout:
        return plan_layout(numel, self.ratio, self.value_dtype or grad_dtype, ratio_of=self.ratio_of)

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
    ) -> torch.Tensor:
        """Dense gradient from a payload; ``accumulate=True`` adds it into ``out`` (the owner's
        gradient buffer) instead of overwriting. ``src_dtype``: the sender's gradient dtype
        (default: the output dtype; matters only without an explicit value_dtype)."""
        if out is None:
            if shape is None or dtype is None:
                raise ValueError("give out, or shape and dtype")
            out = torch.empty(shape, dtype=dtype, device=payload.device)
            accumulate = False
        lay = self.layout(out.numel(), src_dtype or out.dtype)
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
