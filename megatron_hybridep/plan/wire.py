"""The codec's wire format: where each section of one encoded tensor sits and how many bytes it
takes. The one definition: the runtime's codec (runtime/weight_codec.py) lays its buffers out with
it and checks its index dtypes against INDEX_BYTES at import, and the planner sizes compressed
experts and gradients with it (plan/workload.py). Torch-free: value types are given by their size.

An encoded tensor is one flat byte payload whose size depends only on (numel, ratio, value bytes),
so every rank sizes its all-gather buffers without talking. Sections, each starting at a 16-byte
boundary (payloads concatenate in one buffer and still view as typed tensors):

    DENSE:  [weight: numel values]                              (ratio <= 1, or when sparse is not smaller)
    sparse: [values: k values][counts: nblocks counts][offsets: k block-local offsets]

Index schemes (the cheapest for (numel, k) is chosen; padding counted):

    scheme   block     offset   count   index bytes
    BITMAP   2**3      -        1 byte   ceil(n/8)              cheapest for element ratio < ~8.5
    BLOCK8   2**8      1 byte   2 bytes  k + 2*ceil(n/256)      ratio ~8.5 .. 128
    BLOCK16  2**16     2 bytes  4 bytes  2k + 4*ceil(n/65536)   ratio 128 .. ~32768
    FLAT32   1 block   4 bytes  4 bytes  4k + 4                 only for absurd ratios

BITMAP's "count" of a block of 8 elements is its bitmap byte (bit j: element 8b + j is kept) and it
has no offsets: at the 4x of the default returned gradients its index is n/8 bytes against BLOCK8's
~n/4 + n/128, the same kept entries 17.5% smaller with bf16 values.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

RatioOf = Literal["elements", "bytes"]
ALIGN = 16  # every section starts at a 16-byte boundary


class IndexScheme(enum.Enum):
    DENSE = 0
    BITMAP = 3
    BLOCK8 = 8
    BLOCK16 = 16
    FLAT32 = 32

    @property
    def block_bits(self) -> int:
        return self.value


class IndexBytes(NamedTuple):
    offset: int  # one block-local offset per kept entry
    count: int   # one entry count per block


INDEX_BYTES = {IndexScheme.BITMAP: IndexBytes(0, 1), IndexScheme.BLOCK8: IndexBytes(1, 2),
               IndexScheme.BLOCK16: IndexBytes(2, 4), IndexScheme.FLAT32: IndexBytes(4, 4)}
SPARSE_SCHEMES = (IndexScheme.BITMAP, IndexScheme.BLOCK8, IndexScheme.BLOCK16,
                  IndexScheme.FLAT32)  # ties keep the smaller block


def align(x: int) -> int:
    return -(-x // ALIGN) * ALIGN


def nblocks(numel: int, scheme: IndexScheme) -> int:
    if scheme is IndexScheme.DENSE:
        return 0
    return 1 if scheme is IndexScheme.FLAT32 else -(-numel // (1 << scheme.block_bits))


def k_for_ratio(numel: int, ratio: float) -> int:
    """Kept entries for an element ratio: max(1, floor(numel / ratio)); numel when ratio <= 1."""
    if ratio <= 1:
        return numel
    # The 1e-9 slack makes ratio = numel / k give back k despite float rounding.
    return max(1, min(numel, math.floor(numel / ratio * (1 + 1e-9))))


@dataclass(frozen=True)
class WireLayout:
    """Byte offsets of one encoded tensor's sections. Identical on every rank."""

    numel: int
    k: int  # kept entries (== numel for DENSE)
    value_bytes: int
    scheme: IndexScheme

    @property
    def dense(self) -> bool:
        return self.scheme is IndexScheme.DENSE

    @property
    def nblocks(self) -> int:
        return nblocks(self.numel, self.scheme)

    @property
    def noffsets(self) -> int:
        """Block-local offsets stored: one per kept entry (none for DENSE and BITMAP)."""
        return 0 if self.dense or INDEX_BYTES[self.scheme].offset == 0 else self.k

    @property
    def values_at(self) -> int:
        return 0

    @property
    def counts_at(self) -> int:
        return align(self.k * self.value_bytes)

    @property
    def offsets_at(self) -> int:
        if self.dense:
            return self.counts_at
        return align(self.counts_at + self.nblocks * INDEX_BYTES[self.scheme].count)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire, index bytes and alignment padding included."""
        if self.dense:
            return self.counts_at
        return align(self.offsets_at + self.k * INDEX_BYTES[self.scheme].offset)

    @property
    def element_ratio(self) -> float:
        return self.numel / self.k

    @property
    def byte_ratio(self) -> float:
        """Dense bytes / payload bytes (lower than the element ratio: indices cost bytes)."""
        return self.numel * self.value_bytes / self.nbytes


def choose_layout(numel: int, ratio: float, value_bytes: int, *, ratio_of: RatioOf = "elements") -> WireLayout:
    """The layout of one tensor of ``numel`` elements at ``ratio``: an element ratio (k = numel /
    ratio kept), or with ratio_of="bytes" the largest k whose payload fits in dense bytes / ratio.
    Dense when ratio <= 1 or when the sparse payload would not be smaller."""
    dense = WireLayout(numel, numel, value_bytes, IndexScheme.DENSE)
    if ratio <= 1:
        return dense
    if ratio_of == "elements":
        k = k_for_ratio(numel, ratio)
        best = min((WireLayout(numel, k, value_bytes, s) for s in SPARSE_SCHEMES), key=lambda lay: lay.nbytes)
    elif ratio_of == "bytes":
        budget = numel * value_bytes / ratio
        best = None
        for scheme in SPARSE_SCHEMES:
            per = value_bytes + INDEX_BYTES[scheme].offset
            fixed = nblocks(numel, scheme) * INDEX_BYTES[scheme].count
            k = max(1, min(numel, int((budget - fixed) // per)))
            while k > 1 and WireLayout(numel, k, value_bytes, scheme).nbytes > budget:
                k -= 1  # alignment padding; at most a few steps
            lay = WireLayout(numel, k, value_bytes, scheme)
            if best is None or (lay.k, -lay.nbytes) > (best.k, -best.nbytes):
                best = lay
    else:
        raise ValueError(f"ratio_of must be 'elements' or 'bytes', got {ratio_of!r}")
    return dense if best.nbytes >= dense.nbytes else best


def payload_bytes(numel: int, ratio: float, value_bytes: int) -> int:
    """Bytes on the wire for one tensor at an element ratio."""
    return choose_layout(numel, ratio, value_bytes).nbytes


__all__ = ["ALIGN", "INDEX_BYTES", "SPARSE_SCHEMES", "IndexBytes", "IndexScheme", "RatioOf", "WireLayout", "align",
           "choose_layout", "k_for_ratio", "nblocks", "payload_bytes"]
