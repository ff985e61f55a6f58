"""Mixed-radix rank coordinates (paper Eq. 13): the coarsest level is the most significant digit,
so rank = ((c0 * n1) + c1) * n2 + c2 ... This matches torch.distributed rank order when ranks are
launched data-centre by data-centre, node by node."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def place_values(counts: Sequence[int]) -> tuple[int, ...]:
    """Rank distance of one step at each level: (n1*n2*..., ..., n_{L-1}, 1)."""
    out = [1] * len(counts)
    for i in range(len(counts) - 2, -1, -1):
        out[i] = out[i + 1] * int(counts[i + 1])
    return tuple(out)


def coords_of(rank: int, counts: Sequence[int]) -> tuple[int, ...]:
    """Coordinates of one rank, coarse -> fine."""
    out = []
    for n in reversed(counts):
        rank, c = divmod(rank, int(n))
        out.append(c)
    return tuple(reversed(out))


def rank_of(coords: Sequence[int], counts: Sequence[int]) -> int:
    rank = 0
    for c, n in zip(coords, counts, strict=True):
        rank = rank * int(n) + int(c)
    return rank


def coord_array(ranks: np.ndarray, counts: Sequence[int]) -> np.ndarray:
    """Vectorised coords_of: integer array of shape ranks.shape + (L,)."""
    ranks = np.asarray(ranks, dtype=np.int64)
    pv = np.asarray(place_values(counts), dtype=np.int64)
    return (ranks[..., None] // pv) % np.asarray(counts, dtype=np.int64)


def divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


def group_ranks(keys: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """Partition ranks 0..len(keys)-1 by key; groups ordered by key, ranks sorted inside each."""
    order = np.lexsort((np.arange(len(keys)), keys))
    sorted_keys = keys[order]
    cuts = np.flatnonzero(np.diff(sorted_keys)) + 1
    return tuple(tuple(int(r) for r in chunk) for chunk in np.split(order, cuts))
