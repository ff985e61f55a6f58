"""Alpha-beta link model over the world's levels: how long one collective takes and which links it loads.

Every flow from rank a to rank b crosses the *coarsest* level where their coordinates differ. It uses
the sibling link between a's and b's units at that level, and the uplink of every unit that contains
a (egress) or b (ingress) at that level and all finer ones (a GPU's PCIe link carries all its
traffic; a DC's WAN uplink carries everything leaving the DC). All groups of a collective run at
once, so a phase takes as long as its most loaded link or uplink (bytes / bandwidth), plus latency:
one round for an all-to-all (all peers posted at once), one per step for ring collectives, plus
``call_s`` once per collective that moves bytes (a backend's fixed cost per call when asked for:
gloo on shared CPU cores, Workload.call_seconds).

Collectives are costed the way NCCL runs them on these groups: all-to-all as direct sends; all-gather,
reduce-scatter and all-reduce as a ring over the group's ranks in rank order.

Groups are described by a :class:`Family` (congruent groups tiling the world), which gives every
load in closed form: planning 1000 DCs x 8 GPUs needs no G x G matrices. Skewed routing needs real
flows and goes through :meth:`Network.flows` (numpy, O(G x E)). Tests check both against a brute
force over explicit flows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megatron_hybridep.plan.grid import coord_array
from megatron_hybridep.plan.topology import EPLayout, Topology


@dataclass(frozen=True)
class Family:
    """Congruent groups that tile the world's ranks: at level l a group's coordinates are
    {b + k * strides[l] : k < sizes[l]}, with blocks of sizes[l] * strides[l] consecutive values."""

    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def group_size(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class PhaseCost:
    """One collective (or ``count`` repetitions of it)."""

    seconds: float                  # bottleneck bandwidth time + latency
    latency: float
    level_seconds: tuple[float, ...]   # bandwidth time at each world level (busiest link or uplink)
    pair_bytes: tuple[float, ...]      # bytes on the busiest sibling link of each level
    uplink_bytes: tuple[float, ...]    # bytes through the busiest unit uplink of each level

    def scaled(self, k: float) -> PhaseCost:
        return PhaseCost(self.seconds * k, self.latency * k, tuple(x * k for x in self.level_seconds),
                         tuple(x * k for x in self.pair_bytes), tuple(x * k for x in self.uplink_bytes))

    @staticmethod
    def zero(n_levels: int) -> PhaseCost:
        z = (0.0,) * n_levels
        return PhaseCost(0.0, 0.0, z, z, z)


class Network:
    """Link parameters of a Topology in the form the cost model needs."""

    def __init__(self, topology: Topology, call_s: float = 0.0) -> None:
        self.topology = topology
        self.call_s = call_s
        self.counts = topology.level_counts
        self.L = len(self.counts)
        self.bw = tuple(lv.bandwidth for lv in topology.levels)
        self.lat = tuple(lv.latency for lv in topology.levels)
        self.uplink = tuple(lv.uplink for lv in topology.levels)
        self.over = tuple(lv.override_arrays() for lv in topology.levels)
        self._local_cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def _inner(self, values: Sequence[int], lvl: int) -> int:
        return math.prod(values[lvl + 1:])

    # ---- which sibling pairs carry traffic (for per-pair overrides) -----------------------------------
    def _pair_extremes(self, lvl: int, mask_fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
                       n_flowing: int) -> tuple[float, float]:
        """(min bandwidth, max latency) over the ordered sibling pairs of level lvl that carry traffic:
        ``mask_fn`` tells which override pairs flow, ``n_flowing`` how many pairs flow in all."""
        a, b, bw, lat = self.over[lvl]
        if len(a):
            m = mask_fn(a, b)
            n_over = int(m.sum())
        else:
            m, n_over = None, 0
        lo_bw, hi_lat = math.inf, 0.0
        if n_flowing > n_over:
            lo_bw, hi_lat = self.bw[lvl], self.lat[lvl]
        if n_over:
            lo_bw = min(lo_bw, float(bw[m].min()))
            hi_lat = max(hi_lat, float(lat[m].max()))
        return lo_bw, hi_lat

    def _finish(self, pair: list[float], up: list[float], pair_bw: list[float],
                latency: float) -> PhaseCost:
        level_seconds = []
        for lvl in range(self.L):
            t = pair[lvl] / pair_bw[lvl] if pair[lvl] > 0 else 0.0
            if self.uplink[lvl] is not None and up[lvl] > 0:
                t = max(t, up[lvl] / self.uplink[lvl])
            level_seconds.append(t)
        busy = max(level_seconds, default=0.0)
        latency += self.call_s
        return PhaseCost(busy + latency if busy > 0 else 0.0, latency if busy > 0 else 0.0,
                         tuple(level_seconds), tuple(pair), tuple(up))

    # ---- closed forms ------------------------------------------------------------------------------------
    def a2a(self, fam: Family, pair_bytes: float) -> PhaseCost:
        """All-to-all inside every group of ``fam``; each rank sends ``pair_bytes`` to each group peer."""
        n, z, t = self.counts, fam.sizes, fam.strides
        M = fam.group_size
        if M == 1 or pair_bytes <= 0:
            return PhaseCost.zero(self.L)
        pair, up, pbw = [0.0] * self.L, [0.0] * self.L, [math.inf] * self.L
        latency = 0.0
        for lvl in range(self.L):
            inner_n, inner_z = self._inner(n, lvl), self._inner(z, lvl)
            up[lvl] = inner_n * (M - inner_z) * pair_bytes
            if z[lvl] > 1:
                pair[lvl] = inner_n * inner_z * pair_bytes
                blk, st = z[lvl] * t[lvl], t[lvl]
                pbw[lvl], lat = self._pair_extremes(
                    lvl, lambda a, b, blk=blk, st=st: (a // blk == b // blk) & (a % st == b % st),
                    n[lvl] * (z[lvl] - 1))
                latency = max(latency, lat)
        return self._finish(pair, up, pbw, latency)

    def ring(self, fam: Family, edge_bytes: float, steps: int) -> PhaseCost:
        """Ring collective inside every group of ``fam`` (members in rank order); every ring edge
        carries ``edge_bytes`` in total; ``steps`` rounds of latency."""
        n, z, t = self.counts, fam.sizes, fam.strides
        M = fam.group_size
        if M == 1 or edge_bytes <= 0:
            return PhaseCost.zero(self.L)
        j0 = next(lvl for lvl in range(self.L) if z[lvl] > 1)  # the wrap-around edge crosses this level
        pair, up, pbw = [0.0] * self.L, [0.0] * self.L, [math.inf] * self.L
        step_lat = 0.0
        outer = 1
        for lvl in range(self.L):
            groups_in_unit = self._inner(n, lvl) // self._inner(z, lvl)
            outer *= z[lvl]
            if outer > 1:  # the group reaches outside a level-l unit: one ring edge leaves, one enters
                up[lvl] = groups_in_unit * edge_bytes
            if z[lvl] > 1:
                pair[lvl] = groups_in_unit * edge_bytes
                blk, st, last = z[lvl] * t[lvl], t[lvl], (z[lvl] - 1) * t[lvl]
                wrap = lvl == j0

                def flowing(a: np.ndarray, b: np.ndarray, blk: int = blk, st: int = st, last: int = last,
                            wrap: bool = wrap) -> np.ndarray:
                    same = a // blk == b // blk
                    fwd = (b - a == st) & (a % blk < last)
                    back = (a - b == last) & (b % blk < st) if wrap else np.zeros_like(same)
                    return same & (fwd | back)

                pbw[lvl], lat = self._pair_extremes(lvl, flowing, (n[lvl] // z[lvl]) * (z[lvl] - 1 + int(wrap)))
                step_lat = max(step_lat, lat)
        return self._finish(pair, up, pbw, steps * step_lat)

    # ---- explicit flows inside an EP group (skewed routing) ---------------------------------------------
    def _local_links(self, layout: EPLayout, lvl: int) -> tuple[np.ndarray, np.ndarray]:
        """(bandwidth, latency) matrices between the EP group's coordinates at world level l, taking the
        worst over all EP groups (they run the same pattern at the same time)."""
        key = (layout.ep_size, lvl)
        if key in self._local_cache:
            return self._local_cache[key]
        e = layout.extent[lvl]
        bw = np.full((e, e), self.bw[lvl])
        lat = np.full((e, e), self.lat[lvl])
        a, b, obw, olat = self.over[lvl]
        groups = 1
        if len(a) and lvl == layout.outer and e < self.counts[lvl]:
            keep = a // e == b // e  # pairs inside one EP group's span, in local coordinates
            a, b, obw, olat = a[keep] % e, b[keep] % e, obw[keep], olat[keep]
            groups = self.counts[lvl] // e
        if len(a):
            o_bw, o_lat, hits = np.full((e, e), np.inf), np.full((e, e), -np.inf), np.zeros((e, e), np.int64)
            np.minimum.at(o_bw, (a, b), obw)
            np.maximum.at(o_lat, (a, b), olat)
            np.add.at(hits, (a, b), 1)
            # a local pair overridden in every EP group takes the override; otherwise the worst of both
            bw = np.where(hits == groups, o_bw, np.minimum(bw, o_bw))
            lat = np.where(hits == groups, o_lat, np.maximum(lat, o_lat))
        self._local_cache[key] = (bw, lat)
        return bw, lat

    def flows(self, layout: EPLayout, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> PhaseCost:
        """Concurrent point-to-point flows between EP-group ranks (the same in every EP group)."""
        keep = (src != dst) & (nbytes > 0)
        src, dst, w = src[keep], dst[keep], nbytes[keep].astype(np.float64)
        if not len(w):
            return PhaseCost.zero(self.L)
        ext = layout.extent
        cs, cd = coord_array(src, ext), coord_array(dst, ext)
        differs = cs != cd
        first = np.argmax(differs, axis=1)  # coarsest differing level of each flow
        pair, up = [0.0] * self.L, [0.0] * self.L
        level_seconds = [0.0] * self.L
        latency = 0.0
        for lvl in range(layout.outer, self.L):
            inner = math.prod(ext[lvl + 1:])
            leaving = first <= lvl
            if leaving.any():
                eg = np.bincount(src[leaving] // inner, weights=w[leaving])
                ing = np.bincount(dst[leaving] // inner, weights=w[leaving])
                up[lvl] = float(max(eg.max(), ing.max()))
            here = first == lvl
            if here.any():
                e = ext[lvl]
                unit = src[here] // inner  # EP-local unit index at level l (includes its parent)
                key = unit * e + cd[here, lvl]
                uniq, inv = np.unique(key, return_inverse=True)
                load = np.bincount(inv, weights=w[here])
                u, v = uniq // e % e, uniq % e
                bw, lat = self._local_links(layout, lvl)
                pair[lvl] = float(load.max())
                level_seconds[lvl] = float((load / bw[u, v]).max())
                latency = max(latency, float(lat[u, v].max()))
            if self.uplink[lvl] is not None and up[lvl] > 0:
                level_seconds[lvl] = max(level_seconds[lvl], up[lvl] / self.uplink[lvl])
        busy = max(level_seconds)
        latency += self.call_s
        return PhaseCost(busy + latency, latency, tuple(level_seconds), tuple(pair), tuple(up))


# ---- the families a plan uses ------------------------------------------------------------------------------
def world_domain_sizes(layout: EPLayout, domain_sizes: Sequence[int]) -> tuple[int, ...]:
    """A plan's S per plan level, spread onto the world's levels (1 where the EP group has no level)."""
    out = [1] * len(layout.extent)
    for lvl, s in zip(layout.levels, domain_sizes, strict=True):
        out[lvl] = s
    return tuple(out)


def domain_family(layout: EPLayout, S: Sequence[int]) -> Family:
    """Expert all-gather groups: consecutive blocks of S_l at each level."""
    return Family(tuple(S), (1,) * len(S))


def rail_family(layout: EPLayout, S: Sequence[int]) -> Family:
    """Token all-to-all groups: same offset in every block, inside the EP group."""
    return Family(tuple(e // s for e, s in zip(layout.extent, S, strict=True)), tuple(S))


def replica_family(topology: Topology, layout: EPLayout) -> Family:
    """Expert data-parallel groups across EP groups: same EP-local rank in every EP group."""
    n = topology.level_counts
    sizes = [n[lvl] if lvl < layout.outer else 1 for lvl in range(len(n))]
    strides = [1] * len(n)
    sizes[layout.outer] = n[layout.outer] // layout.extent[layout.outer]
    strides[layout.outer] = layout.extent[layout.outer]
    return Family(tuple(sizes), tuple(strides))


def dc_replica_family(topology: Topology) -> Family:
    """Replicated experts: the same local rank in every DC of the world."""
    n = topology.level_counts
    return Family((n[0],) + (1,) * (len(n) - 1), (1,) * len(n))
