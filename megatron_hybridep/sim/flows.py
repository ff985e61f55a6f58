"""Flows of the collectives, reduced by the translation symmetry of the world.

A :class:`Space` is a set of levels (counts n_l, coarse to fine) with the links of plan/topology.py:
a flow from rank a to rank b crosses the coarsest level l where their coordinates differ, on the
sibling link between a's and b's level-l units, and through the egress uplinks of a's units and the
ingress uplinks of b's units at levels l..L-1 (as plan/network.py).

Symmetry. Shifting coordinate c_l by pi_l (mod n_l) at every level maps the traffic of every
collective here onto itself when pi_l is a *period* of all of them and of the link parameters (a
level with per-pair overrides has period n_l). The group of such shifts acts freely on ranks, so
every flow orbit has exactly one member whose source is a *representative* (c_l < pi_l at every
level). Max-min fair shares are unique, hence equal on an orbit: simulating one flow per orbit
("flow class") with the number of its orbit-mates on each link ("count") is exact. An orbit-mate
count on a link at level j is prod_{i>j} n_i / pi_i.

Size: R = prod pi_l representatives; an all-to-all over groups of M ranks has R (M - 1) classes, a
ring R. Balanced plain EP over 1000 DCs x 8 GPUs: pi = (1, 1), 7999 classes instead of 64 million
flows. Explicit flows (skewed routing) use pi = n.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.network import Family
from megatron_hybridep.plan.topology import Level

A2A, RING, PAIRS = "a2a", "ring", "pairs"
SIB, UP_OUT, UP_IN = 0, 1, 2
MAX_CLASSES = 4_000_000  # flow classes of one collective: beyond this numpy memory (~0.5 GB) becomes the limit


@dataclass(frozen=True, eq=False)
class Collective:
    """One communication operation, before it is placed in a Space.

    a2a:   every rank sends ``nbytes`` to every other member of its group of ``family``;
    ring:  every rank sends ``nbytes`` to the next member of its group (rank order, wrapping), with
           ``steps`` latency rounds (NCCL ring all-gather / reduce-scatter / all-reduce);
    pairs: explicit flows ``src`` -> ``dst`` (space rank numbers) of ``pair_bytes`` (skewed routing).
    """

    name: str
    kind: str
    family: Family | None = None
    nbytes: float = 0.0
    steps: int = 1
    src: np.ndarray | None = None
    dst: np.ndarray | None = None
    pair_bytes: np.ndarray | None = None

    @property
    def empty(self) -> bool:
        if self.kind == PAIRS:
            assert self.pair_bytes is not None and self.src is not None and self.dst is not None
            return not bool(np.any((self.pair_bytes > 0) & (self.src != self.dst)))
        assert self.family is not None
        return self.family.group_size <= 1 or self.nbytes <= 0

    def periods(self, counts: Sequence[int]) -> tuple[int, ...]:
        """The smallest shift at each level that maps this collective's flows onto themselves."""
        if self.kind == PAIRS:
            return tuple(counts)
        assert self.family is not None
        z, t = self.family.sizes, self.family.strides
        coarsest = next((lvl for lvl in range(len(z)) if z[lvl] > 1), None)
        out = []
        for lvl, n in enumerate(counts):
            block = z[lvl] * t[lvl]
            if z[lvl] == 1:
                out.append(1)                      # singleton at this level: any shift
            elif block == n and (self.kind == A2A or lvl == coarsest):
                out.append(1)                      # one block, cyclic: shift by 1 permutes the groups
            else:
                out.append(block)                  # shift whole blocks (a ring's inner levels too)
        return tuple(out)


@dataclass
class FlowSet:
    """Flow classes of one collective in a Space, with their link incidence (COO)."""

    name: str
    nbytes: np.ndarray          # (F,) bytes of each flow of the class
    tail: np.ndarray            # (F,) latency added after the last byte leaves (alpha of the rounds)
    inc_flow: np.ndarray        # (K,) flow class of each incidence entry
    inc_code: np.ndarray        # (K,) link class code (Space.link_code layout)
    inc_count: np.ndarray       # (K,) flows of this class on one link of this class
    level_bytes: np.ndarray     # (L,) bytes per rank that cross each level (sibling links)
    inc_link: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # compact ids, after finalize
    uplink_bytes: np.ndarray | None = None   # (L,) bytes through the busiest uplink of each level

    @property
    def size(self) -> int:
        return len(self.nbytes)


class Space:
    """Levels and links in which collectives run; builds flow classes and the shared link table."""

    def __init__(self, levels: Sequence[Level], counts: Sequence[int], periods: Sequence[int] | None = None,
                 overrides: Sequence[dict[tuple[int, int], tuple[float, float]]] | None = None,
                 call_s: float = 0.0) -> None:
        self.levels = tuple(levels)
        self.call_s = call_s  # the backend's fixed cost per collective call (Workload.call_seconds)
        self.counts = tuple(int(c) for c in counts)
        self.L = len(self.counts)
        self.bw = np.array([lv.bandwidth for lv in self.levels], dtype=np.float64)
        self.lat = np.array([lv.latency for lv in self.levels], dtype=np.float64)
        self.uplink = np.array([lv.uplink if lv.uplink is not None else np.inf for lv in self.levels])
        if overrides is None:
            overrides = [_override_map(lv) for lv in self.levels]
        self.overrides = [dict(o) for o in overrides]
        base = tuple(n if self.overrides[i] else 1 for i, n in enumerate(self.counts))
        self.periods = _lcm_periods(base, periods or (1,) * self.L, self.counts)
        self.flowsets: list[FlowSet] = []
        self.link_codes = np.zeros(0, np.int64)
        self.link_cap = np.zeros(0)

    @staticmethod
    def periods_for(collectives: Sequence[Collective], counts: Sequence[int]) -> tuple[int, ...]:
        out = (1,) * len(counts)
        for c in collectives:
            if not c.empty:
                out = _lcm_periods(out, c.periods(counts), counts)
        return out

    # ---- representatives and multiplicities -------------------------------------------------------
    @property
    def reps(self) -> int:
        return math.prod(self.periods)

    def rep_coords(self) -> np.ndarray:
        return np.indices(self.periods).reshape(self.L, -1).T.astype(np.int64)

    def orbit_factor(self, level: int) -> int:
        """Orbit-mates of a flow class on one link at ``level``: prod_{i > level} n_i / pi_i."""
        return math.prod(n // p for n, p in zip(self.counts[level + 1:], self.periods[level + 1:], strict=True))

    # ---- link codes --------------------------------------------------------------------------------
    def _code_sizes(self) -> list[tuple[int, int, int]]:
        """(kind, level, size) of each code block: sibling (coarser reps, unit, delta), uplinks (coords <= j)."""
        out = []
        for lvl in range(self.L):
            coarse = math.prod(self.periods[:lvl])
            out.append((SIB, lvl, coarse * self.periods[lvl] * self.counts[lvl]))
            out.append((UP_OUT, lvl, coarse * self.periods[lvl]))
            out.append((UP_IN, lvl, coarse * self.periods[lvl]))
        return out

    def _offsets(self) -> dict[tuple[int, int], int]:
        off, acc = {}, 0
        for kind, lvl, size in self._code_sizes():
            off[(kind, lvl)] = acc
            acc += size
        return off

    def _prefix(self, coords: np.ndarray, upto: int) -> np.ndarray:
        """Mixed-radix code of coordinates (mod periods) at levels 0..upto inclusive."""
        code = np.zeros(len(coords), np.int64)
        for lvl in range(upto + 1):
            code = code * self.periods[lvl] + coords[:, lvl] % self.periods[lvl]
        return code

    # ---- flows -------------------------------------------------------------------------------------
    def flows(self, coll: Collective) -> FlowSet:
        """Flow classes of ``coll`` (sources = representatives), with link incidence and latencies."""
        if coll.kind == PAIRS:
            src, dst, nbytes = self._pairs(coll)
        else:
            src, dst = self._family_flows(coll)
            nbytes = np.full(len(src), float(coll.nbytes))
        keep = np.any(src != dst, axis=1) & (nbytes > 0)
        src, dst, nbytes = src[keep], dst[keep], nbytes[keep]
        F = len(nbytes)
        cross = np.argmax(src != dst, axis=1) if F else np.zeros(0, np.int64)
        lat = self.lat[cross].copy() if F else np.zeros(0)
        off = self._offsets()
        flows_i, codes, counts = [], [], []
        idx = np.arange(F)
        for lvl in range(self.L):
            here = cross == lvl
            if here.any():
                s, d = src[here], dst[here]
                delta = (d[:, lvl] - s[:, lvl]) % self.counts[lvl]
                code = (self._prefix(s, lvl) * self.counts[lvl] + delta) + off[(SIB, lvl)]
                flows_i.append(idx[here])
                codes.append(code)
                counts.append(np.full(int(here.sum()), self.orbit_factor(lvl), np.float64))
                if self.overrides[lvl]:
                    lat[here] = self._pair_values(lvl, s[:, lvl], d[:, lvl], 1, lat[here])
            if np.isfinite(self.uplink[lvl]):
                through = cross <= lvl  # flows leaving (entering) a level-lvl unit
                if through.any():
                    k = int(through.sum())
                    fac = np.full(k, self.orbit_factor(lvl), np.float64)
                    flows_i += [idx[through], idx[through]]
                    codes += [self._prefix(src[through], lvl) + off[(UP_OUT, lvl)],
                              self._prefix(dst[through], lvl) + off[(UP_IN, lvl)]]
                    counts += [fac, fac]
        if coll.kind == RING:
            tail = np.full(F, coll.steps * (float(lat.max()) if F else 0.0))
        else:
            tail = lat
        tail = tail + self.call_s
        level_bytes = np.zeros(self.L)
        if F:
            # bytes per rank crossing each level: every representative stands for the same traffic
            np.add.at(level_bytes, cross, nbytes)
            level_bytes /= self.reps
        cat = (lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt))
        fs = FlowSet(coll.name, nbytes.astype(np.float64), tail, cat(flows_i, np.int64), cat(codes, np.int64),
                     cat(counts, np.float64), level_bytes)
        self.flowsets.append(fs)
        return fs

    def _family_flows(self, coll: Collective) -> tuple[np.ndarray, np.ndarray]:
        fam = coll.family
        assert fam is not None
        z = np.asarray(fam.sizes, np.int64)
        t = np.asarray(fam.strides, np.int64)
        if len(z) != self.L:
            raise PlanError(f"{coll.name}: family has {len(z)} levels, the space {self.L}")
        reps = self.rep_coords()
        block = z * t
        pos = reps % block
        k = pos // t                                 # member index at each level
        base = reps - k * t                          # the member with k = 0
        if coll.kind == RING:
            nxt = k.copy()
            carry = np.ones(len(k), bool)
            for lvl in range(self.L - 1, -1, -1):    # mixed-radix increment, finest level fastest
                inc = nxt[:, lvl] + carry
                wrap = inc >= z[lvl]
                nxt[:, lvl] = np.where(wrap, 0, inc)
                carry = carry & wrap
            return reps, base + nxt * t
        M = int(np.prod(z))
        F = len(reps) * (M - 1)
        if F > MAX_CLASSES:
            raise PlanError(f"{coll.name}: {F:,} flow classes ({len(reps)} representatives x {M - 1} peers) "
                            f"exceed {MAX_CLASSES:,}; fix: use balanced routing and no per-pair overrides at the "
                            "levels the all-to-all spans (they remove the symmetry), or a smaller EP group")
        members = np.indices(tuple(z)).reshape(self.L, -1).T   # (M, L)
        dst = base[:, None, :] + members[None, :, :] * t        # (R, M, L)
        src = np.broadcast_to(reps[:, None, :], dst.shape)
        return src.reshape(-1, self.L), dst.reshape(-1, self.L)

    def _pairs(self, coll: Collective) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        assert coll.src is not None and coll.dst is not None and coll.pair_bytes is not None
        if self.periods != self.counts:
            raise PlanError(f"{coll.name}: explicit flows need periods == counts ({self.counts}), got {self.periods}")
        if len(coll.pair_bytes) > MAX_CLASSES:
            raise PlanError(f"{coll.name}: {len(coll.pair_bytes):,} explicit flows exceed {MAX_CLASSES:,}; fix: "
                            "simulate skewed routing on a smaller EP group, or use balanced routing")
        pv = np.cumprod((1,) + self.counts[::-1])[:-1][::-1]
        to = (lambda r: (np.asarray(r, np.int64)[:, None] // pv) % np.asarray(self.counts))
        return to(coll.src), to(coll.dst), np.asarray(coll.pair_bytes, np.float64)

    def _pair_values(self, lvl: int, u: np.ndarray, v: np.ndarray, which: int, default: np.ndarray) -> np.ndarray:
        """Per-pair override (which = 0 bandwidth, 1 latency) for units u -> v at ``lvl``."""
        out = default.copy()
        table = self.overrides[lvl]
        for (a, b), vals in table.items():
            out[(u == a) & (v == b)] = vals[which]
        return out

    # ---- the shared link table -----------------------------------------------------------------------
    def finalize(self) -> None:
        """Give every link class used by any flow set a compact id and a capacity (bytes/s)."""
        allc = [fs.inc_code for fs in self.flowsets]
        self.link_codes = np.unique(np.concatenate(allc)) if allc else np.zeros(0, np.int64)
        self.link_cap = self._capacities(self.link_codes)
        for fs in self.flowsets:
            fs.inc_link = np.searchsorted(self.link_codes, fs.inc_code)
            per_link = np.bincount(fs.inc_link, weights=fs.inc_count * fs.nbytes[fs.inc_flow],
                                   minlength=len(self.link_codes))
            fs.uplink_bytes = np.zeros(self.L)
            for kind, lvl, lo, hi in self._blocks():
                if kind == UP_OUT:
                    sel = (self.link_codes >= lo) & (self.link_codes < hi)
                    if sel.any():
                        fs.uplink_bytes[lvl] = float(per_link[sel].max())

    def _blocks(self) -> list[tuple[int, int, int, int]]:
        off = self._offsets()
        return [(kind, lvl, off[(kind, lvl)], off[(kind, lvl)] + size) for kind, lvl, size in self._code_sizes()]

    def _capacities(self, codes: np.ndarray) -> np.ndarray:
        cap = np.empty(len(codes))
        for kind, lvl, lo, hi in self._blocks():
            sel = (codes >= lo) & (codes < hi)
            if not sel.any():
                continue
            if kind != SIB:
                cap[sel] = self.uplink[lvl]
                continue
            local = codes[sel] - lo
            delta = local % self.counts[lvl]
            u = (local // self.counts[lvl]) % self.periods[lvl]
            v = (u + delta) % self.counts[lvl]
            cap[sel] = self._pair_values(lvl, u, v, 0, np.full(int(sel.sum()), self.bw[lvl]))
        return cap


def _override_map(level: Level) -> dict[tuple[int, int], tuple[float, float]]:
    a, b, bw, lat = level.override_arrays()
    return {(int(x), int(y)): (float(w), float(t)) for x, y, w, t in zip(a, b, bw, lat, strict=True)}


def _lcm_periods(a: Sequence[int], b: Sequence[int], counts: Sequence[int]) -> tuple[int, ...]:
    out = []
    for x, y, n in zip(a, b, counts, strict=True):
        p = math.lcm(int(x), int(y))
        if n % p:  # cannot happen for divisors of n; keep the space consistent anyway
            p = n
        out.append(p)
    return tuple(out)
