"""Where the ranks are and how fast the links between them are.

A topology is a list of levels, coarse to fine (dc > node > gpu). Rank order is mixed-radix with the
coarsest level most significant (grid.py), as torch.distributed numbers ranks when a job is launched
DC by DC. Per level:

- ``bandwidth_gbps`` / ``latency_us``: one link between two sibling units of this level (DC to DC,
  node to node inside a DC, GPU to GPU inside a node), per direction;
- ``uplink_gbps`` (optional): the capacity that connects ONE unit to all its siblings, shared by
  every rank inside it (a DC's WAN uplink, a node's NIC, a GPU's PCIe link). This is where
  contention shows: eight GPUs behind one 10 Gbit/s NIC get 1.25 Gbit/s each. Unset = no shared limit;
- ``overrides``: per-pair exceptions (heterogeneous WANs), by coordinate at this level, symmetric.

The EP group is a contiguous block of ``ep_size`` ranks (Megatron's order with TP=CP=1), so it covers
the innermost levels completely and part of one level; :meth:`Topology.ep_layout` derives that.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.fields import FieldReader, check_int, load_yaml
from megatron_hybridep.plan.grid import divisors

GBPS = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True)
class LinkOverride:
    """A link between units ``a`` and ``b`` (coordinates at its level) that differs from the level default."""

    a: int
    b: int
    bandwidth_gbps: float
    latency_us: float


@dataclass(frozen=True)
class Level:
    name: str
    count: int
    bandwidth_gbps: float
    latency_us: float = 0.0
    uplink_gbps: float | None = None
    overrides: tuple[LinkOverride, ...] = ()

    @property
    def bandwidth(self) -> float:
        """Bytes per second of one sibling link."""
        return self.bandwidth_gbps * GBPS

    @property
    def latency(self) -> float:
        return self.latency_us * 1e-6

    @property
    def uplink(self) -> float | None:
        return None if self.uplink_gbps is None else self.uplink_gbps * GBPS

    def override_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Overrides in both directions as arrays (a, b, bytes/s, seconds), for vectorised lookups."""
        if not self.overrides:
            e = np.zeros(0)
            return e.astype(np.int64), e.astype(np.int64), e, e
        a = np.array([o.a for o in self.overrides] + [o.b for o in self.overrides], dtype=np.int64)
        b = np.array([o.b for o in self.overrides] + [o.a for o in self.overrides], dtype=np.int64)
        bw = np.array([o.bandwidth_gbps for o in self.overrides] * 2) * GBPS
        lat = np.array([o.latency_us for o in self.overrides] * 2) * 1e-6
        return a, b, bw, lat


@dataclass(frozen=True)
class EPLayout:
    """How one EP group sits in the world's levels.

    ``extent[l]``: how many coordinate values of world level l one EP group spans (n_l for the levels
    it covers fully, a divisor d of n_l at ``outer``, 1 above). ``levels``: the world levels with
    extent > 1, i.e. the plan's levels (coarse -> fine).
    """

    ep_size: int
    outer: int
    extent: tuple[int, ...]
    levels: tuple[int, ...]
    names: tuple[str, ...]
    counts: tuple[int, ...]
    num_groups: int

    @property
    def spans_dcs(self) -> bool:
        """Whether the EP group spans more than one unit of the coarsest (data-centre) level."""
        return self.extent[0] > 1


@dataclass(frozen=True)
class Topology:
    levels: tuple[Level, ...]
    name: str = ""
    description: str = ""
    source: str = field(default="topology", compare=False)
    memory_gb_per_gpu: float | None = None   # device memory of one rank (GB = 1e9 bytes); None = not stated

    @property
    def memory_bytes(self) -> float | None:
        return None if self.memory_gb_per_gpu is None else self.memory_gb_per_gpu * 1e9

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", tuple(self.levels))
        m = self.memory_gb_per_gpu
        if m is not None and (isinstance(m, bool) or not isinstance(m, int | float)
                              or not (m > 0 and math.isfinite(m))):
            raise PlanError(f"{self.source}.memory_gb_per_gpu: must be a positive number of GB, got {m!r}; "
                            "fix: give the memory of one GPU, e.g. 80 for an H100 80GB")
        if not self.levels:
            raise PlanError(f"{self.source}.levels: empty; fix: list the levels coarse to fine, e.g. dc, gpu")
        names = [lv.name for lv in self.levels]
        for i, lv in enumerate(self.levels):
            where = f"{self.source}.levels[{i}]"
            if names.count(lv.name) > 1:
                raise PlanError(f"{where}.name: duplicate level name {lv.name!r}; fix: name each level once")
            check_int(lv.count, f"{where}.count", minimum=1, fix="use the number of units at this level")
            for key in ("bandwidth_gbps", "uplink_gbps"):
                v = getattr(lv, key)
                if v is not None and not (v > 0 and math.isfinite(v)):
                    raise PlanError(f"{where}.{key}: must be a positive number of Gbit/s, got {v!r}; "
                                    "fix: give the link speed, e.g. 10 for 10 Gbit/s Ethernet")
            if not (lv.latency_us >= 0 and math.isfinite(lv.latency_us)):
                raise PlanError(f"{where}.latency_us: must be >= 0, got {lv.latency_us!r}; "
                                "fix: give the one-way latency in microseconds")
            seen = set()
            for j, o in enumerate(lv.overrides):
                ow = f"{where}.overrides[{j}]"
                if not (0 <= o.a < lv.count and 0 <= o.b < lv.count) or o.a == o.b:
                    raise PlanError(f"{ow}.between: [{o.a}, {o.b}] must be two different units in "
                                    f"0..{lv.count - 1}; fix: use {lv.name} indices of this level")
                if frozenset((o.a, o.b)) in seen:
                    raise PlanError(f"{ow}.between: pair [{o.a}, {o.b}] given twice; fix: keep one entry")
                seen.add(frozenset((o.a, o.b)))
                if not o.bandwidth_gbps > 0 or not o.latency_us >= 0:
                    raise PlanError(f"{ow}: bandwidth_gbps must be > 0 and latency_us >= 0; fix: correct them")

    # ---- shape --------------------------------------------------------------------------------------
    @property
    def level_names(self) -> tuple[str, ...]:
        return tuple(lv.name for lv in self.levels)

    @property
    def level_counts(self) -> tuple[int, ...]:
        return tuple(lv.count for lv in self.levels)

    @property
    def world_size(self) -> int:
        return math.prod(self.level_counts)

    def describe(self) -> str:
        return " x ".join(f"{lv.count} {lv.name}" for lv in self.levels) + f" = {self.world_size} ranks"

    # ---- the EP group ---------------------------------------------------------------------------------
    def feasible_ep_sizes(self, num_experts: int | None = None) -> tuple[int, ...]:
        """EP sizes whose contiguous rank block fits the level structure (and divides the experts)."""
        sizes = set()
        inner = 1
        for lv in reversed(self.levels):
            sizes.update(d * inner for d in divisors(lv.count))
            inner *= lv.count
        return tuple(sorted(s for s in sizes if num_experts is None or num_experts % s == 0))

    def ep_layout(self, ep_size: int) -> EPLayout:
        ep_size = check_int(ep_size, "ep_size", minimum=1, fix="pass a positive --ep-size")
        if self.world_size % ep_size:
            raise PlanError(f"ep_size: {ep_size} does not divide the world size {self.world_size} "
                            f"({self.describe()}); fix: use one of {list(self.feasible_ep_sizes())}")
        extent = [1] * len(self.levels)
        rest = ep_size
        outer = len(self.levels) - 1
        for lvl in range(len(self.levels) - 1, -1, -1):
            n = self.levels[lvl].count
            if rest % n == 0:
                extent[lvl], rest = n, rest // n
                outer = lvl
                if rest == 1:
                    break
            else:
                if n % rest:
                    raise PlanError(
                        f"ep_size: {ep_size} ranks do not fit the levels {self.describe()}: an EP group is "
                        f"a contiguous block of ranks, so it must cover whole inner levels and a divisor of "
                        f"one level; fix: use one of {list(self.feasible_ep_sizes())}")
                extent[lvl], rest, outer = rest, 1, lvl
                break
        if rest != 1:  # pragma: no cover - excluded by the world-size check
            raise PlanError(f"ep_size: {ep_size} larger than the world; fix: use <= {self.world_size}")
        keep = tuple(lvl for lvl in range(len(self.levels)) if extent[lvl] > 1) or (len(self.levels) - 1,)
        return EPLayout(ep_size=ep_size, outer=outer, extent=tuple(extent), levels=keep,
                        names=tuple(self.levels[lvl].name for lvl in keep),
                        counts=tuple(extent[lvl] for lvl in keep),
                        num_groups=self.world_size // ep_size)

    def check_experts(self, num_experts: int, ep_size: int) -> None:
        if num_experts % ep_size:
            raise PlanError(f"model.num_experts: {num_experts} experts cannot be split evenly over "
                            f"ep_size={ep_size}; fix: use --ep-size one of "
                            f"{list(self.feasible_ep_sizes(num_experts))}")

    def default_ep_size(self, num_experts: int) -> int:
        """The largest EP group that fits the levels and splits the experts evenly."""
        return max(self.feasible_ep_sizes(num_experts))

    # ---- loading ----------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Any, source: str = "topology") -> Topology:
        r = FieldReader(data, source)
        name = r.string("name", "")
        description = r.string("description", "")
        raw_levels = r.raw("levels")
        world = r.integer("world_size", None, minimum=1)
        memory = r.number("memory_gb_per_gpu", None, positive=True,
                          fix="give the memory of one GPU in GB, e.g. 80 for an H100 80GB")
        r.done()
        if not isinstance(raw_levels, list) or not raw_levels:
            raise PlanError(f"{source}.levels: expected a non-empty list of levels, coarse to fine; "
                            "fix: e.g. levels: [{name: dc, count: 2, ...}, {name: gpu, count: 8, ...}]")
        levels = tuple(level_from_dict(lv, f"{source}.levels[{i}]") for i, lv in enumerate(raw_levels))
        topo = cls(levels, name, description, source, memory)
        if world is not None and world != topo.world_size:
            raise PlanError(f"{source}.world_size: {world} but the level counts multiply to "
                            f"{topo.world_size} ({topo.describe()}); fix: correct the counts or world_size")
        return topo

    @classmethod
    def from_yaml(cls, path: str) -> Topology:
        return cls.from_dict(load_yaml(path), source=path)

    def to_dict(self) -> dict[str, Any]:
        levels = []
        for lv in self.levels:
            d: dict[str, Any] = {"name": lv.name, "count": lv.count, "bandwidth_gbps": lv.bandwidth_gbps,
                                 "latency_us": lv.latency_us}
            if lv.uplink_gbps is not None:
                d["uplink_gbps"] = lv.uplink_gbps
            if lv.overrides:
                d["overrides"] = [{"between": [o.a, o.b], "bandwidth_gbps": o.bandwidth_gbps,
                                   "latency_us": o.latency_us} for o in lv.overrides]
            levels.append(d)
        out = {"name": self.name, "description": self.description, "world_size": self.world_size,
               "levels": levels}
        if self.memory_gb_per_gpu is not None:
            out["memory_gb_per_gpu"] = self.memory_gb_per_gpu
        return out

    def with_counts(self, counts: Sequence[int], source: str | None = None) -> Topology:
        """Same links, new unit counts (used when SLURM supplies the counts)."""
        if len(counts) != len(self.levels):
            raise PlanError(f"{self.source}.levels: {len(self.levels)} levels but {len(counts)} counts")
        levels = tuple(Level(lv.name, int(c), lv.bandwidth_gbps, lv.latency_us, lv.uplink_gbps, lv.overrides)
                       for lv, c in zip(self.levels, counts, strict=True))
        return Topology(levels, self.name, self.description, source or self.source, self.memory_gb_per_gpu)

    def pipeline_stage(self, pp: int) -> Topology:
        """The ranks of one pipeline stage: Megatron orders ranks tp-cp-ep-dp-pp, so a stage is a
        contiguous block of world / PP ranks (EP groups, expert replicas and the dense data-parallel
        group live inside it). Overrides of the first stage's span are kept."""
        if pp == 1:
            return self
        if self.world_size % pp:
            raise PlanError(f"pipeline_model_parallel_size: {pp} does not divide the world size {self.world_size} "
                            f"({self.describe()}); fix: use a divisor of it")
        try:
            lay = self.ep_layout(self.world_size // pp)
        except PlanError:
            raise PlanError(f"pipeline_model_parallel_size: stages of {self.world_size // pp} ranks do not fit the "
                            f"levels {self.describe()} (a stage is a contiguous block: whole inner levels and a "
                            "divisor of one level); fix: use another PP size") from None
        levels = []
        for lv, e in zip(self.levels, lay.extent, strict=True):
            over = tuple(o for o in lv.overrides if o.a < e and o.b < e)
            levels.append(Level(lv.name, e, lv.bandwidth_gbps, lv.latency_us, lv.uplink_gbps, over))
        return Topology(tuple(levels), self.name, self.description, f"{self.source} (one of {pp} pipeline stages)",
                        self.memory_gb_per_gpu)


_LEVEL_FIX = "fix: give the link speed in Gbit/s, e.g. 10 for 10 Gbit/s Ethernet, 128 for PCIe 3.0 x16"


def level_from_dict(data: Any, where: str, *, count: int | None = None) -> Level:
    """One level mapping. ``count`` supplied by the caller (SLURM) replaces a count in the file."""
    r = FieldReader(data, where)
    name = r.string("name")
    n = r.integer("count", count, minimum=1, fix="use the number of units at this level")
    if count is not None:
        n = count
    bw = r.number("bandwidth_gbps", positive=True, fix=_LEVEL_FIX)
    lat = r.number("latency_us", 0.0, non_negative=True, fix="give the one-way latency in microseconds")
    up = r.number("uplink_gbps", None, positive=True,
                  fix="give the capacity shared by all ranks of one unit, in Gbit/s, or leave it out")
    raw_over = r.raw("overrides", [])
    r.done()
    if not isinstance(raw_over, list):
        raise PlanError(f"{where}.overrides: expected a list of {{between: [a, b], bandwidth_gbps, latency_us}}")
    overrides = []
    for j, od in enumerate(raw_over):
        orr = FieldReader(od, f"{where}.overrides[{j}]")
        pair = orr.raw("between")
        if not (isinstance(pair, list) and len(pair) == 2):
            raise PlanError(f"{orr.field('between')}: expected [a, b] (two {name} indices), got {pair!r}")
        a = check_int(pair[0], orr.field("between[0]"), minimum=0)
        b = check_int(pair[1], orr.field("between[1]"), minimum=0)
        obw = orr.number("bandwidth_gbps", bw, positive=True, fix=_LEVEL_FIX)
        olat = orr.number("latency_us", lat, non_negative=True, fix="give the latency in microseconds")
        orr.done()
        overrides.append(LinkOverride(a, b, obw, olat))
    return Level(name, n, bw, lat, up, tuple(overrides))
