"""The paper's Algorithm 1: classify a rank pair at one level as expert all-gather (AG), token
all-to-all (A2A) or neither.

At level l, ranks a and b are a *direct pair* when their coordinates differ at l only. Then:
- AG   if they are in the same domain block at l (c_l // S_l equal): they exchange experts;
- A2A  if they are in different blocks but at the same offset (c_l % S_l equal): they exchange tokens;
- NONE otherwise.
The paper checks only the coordinates *below* l; we also require the coordinates *above* l to be
equal (otherwise e.g. GPU 0 of DC 0 and GPU 1 of DC 1 would count as a GPU-level pair).

Closed forms (ordered pairs): AG at l = G (S_l - 1), A2A at l = G (n_l / S_l - 1); with one level
that is the paper's Table VII: A2A G(G/S - 1), AG G(S - 1). The AG graph's connected components are
exactly the plan's domains and the A2A graph's are its rails (tests check both).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum

import numpy as np

from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.grid import coord_array, coords_of


class PairKind(StrEnum):
    AG = "ag"
    A2A = "a2a"
    NONE = "none"


def _check(level_counts: Sequence[int], domain_sizes: Sequence[int]) -> None:
    if len(level_counts) != len(domain_sizes):
        raise PlanError("domain_sizes: need one S per level; fix: pass as many domain sizes as levels")
    for i, (n, s) in enumerate(zip(level_counts, domain_sizes, strict=True)):
        if n < 1 or s < 1 or n % s:
            raise PlanError(f"domain_sizes[{i}]: S={s} must divide the level count {n}; fix: pick a divisor")


def classify_pair(level_counts: Sequence[int], domain_sizes: Sequence[int], a: int, b: int,
                  level: int) -> PairKind:
    """Algorithm 1 for one ordered pair (a, b) at one level, with the extra check above the level."""
    _check(level_counts, domain_sizes)
    G = math.prod(level_counts)
    if not (0 <= a < G and 0 <= b < G and 0 <= level < len(level_counts)):
        raise PlanError(f"pair ({a}, {b}) at level {level}: out of range; fix: ranks < {G}, "
                        f"level < {len(level_counts)}")
    ca, cb = coords_of(a, level_counts), coords_of(b, level_counts)
    if ca[:level] != cb[:level] or ca[level + 1:] != cb[level + 1:] or ca[level] == cb[level]:
        return PairKind.NONE
    s = domain_sizes[level]
    if ca[level] // s == cb[level] // s:
        return PairKind.AG
    if ca[level] % s == cb[level] % s:
        return PairKind.A2A
    return PairKind.NONE


def pair_matrix(level_counts: Sequence[int], domain_sizes: Sequence[int], level: int) -> np.ndarray:
    """Vectorised classify_pair for all ordered pairs at one level: G x G array of 0 (none), 1 (AG),
    2 (A2A). Meant for tests and small groups (G^2 memory)."""
    _check(level_counts, domain_sizes)
    G = math.prod(level_counts)
    c = coord_array(np.arange(G), level_counts)
    others = [j for j in range(len(level_counts)) if j != level]
    same_elsewhere = np.all(c[:, None, others] == c[None, :, others], axis=-1)
    x, y = c[:, None, level], c[None, :, level]
    s = domain_sizes[level]
    direct = same_elsewhere & (x != y)
    ag = direct & (x // s == y // s)
    a2a = direct & (x // s != y // s) & (x % s == y % s)
    return ag.astype(np.int8) + 2 * a2a.astype(np.int8)


def count_pairs(level_counts: Sequence[int], domain_sizes: Sequence[int]) -> dict[int, dict[PairKind, int]]:
    """Ordered AG and A2A pair counts per level, closed form."""
    _check(level_counts, domain_sizes)
    G = math.prod(level_counts)
    return {lvl: {PairKind.AG: G * (s - 1), PairKind.A2A: G * (n // s - 1)}
            for lvl, (n, s) in enumerate(zip(level_counts, domain_sizes, strict=True))}


def table_vii(G: int) -> dict[int, tuple[int, int]]:
    """The paper's Table VII row for one-level EP of size G: {S: (A2A pairs, AG pairs)}."""
    return {s: (G * (G // s - 1), G * (s - 1)) for s in range(1, G + 1) if G % s == 0}
