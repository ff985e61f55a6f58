"""The Plan: which EP ranks share experts (domains) and which exchange tokens (rails).

A plan is a grid over the EP group's mixed-radix coordinates (see grid.py). At every level l the
coordinate c_l is split into a *block* c_l // S_l and an *offset* c_l % S_l:

- domain of a rank = ranks with the same block at every level (they all-gather each other's experts);
- rail of a rank   = ranks with the same offset at every level (they exchange tokens by all-to-all).

Every domain meets every rail in exactly one rank, which is why a token for expert e sent from
rank r is computed by ``compute_rank(r, e)``: the member of e's owner's domain that sits on r's rail.
S_l = 1 everywhere is plain EP (domains are single ranks, one rail = the whole group).

kind="replicated" is what Megatron users run today across DCs: EP inside each DC (the rail is a DC)
and every expert replicated in every DC (the domain is the same local index in all DCs, and its
members all-reduce gradients instead of all-gathering weights). It uses the grid with
S = (n_dc, 1, ..., 1); its expert layout is Megatron's for EP = rail size.

``replicas`` (kind="domains" only, see replicas.py) adds hot-expert copies on top of the grid: a rank
holding a replica of expert e computes its own tokens for e, so ``compute_rank(r, e) = r`` there.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.grid import coord_array, coords_of, group_ranks, place_values, rank_of
from megatron_hybridep.plan.replicas import Replicas

__all__ = ["PlanError", "Plan", "Replicas", "KINDS", "default_level_names"]

KINDS = ("domains", "replicated")
FORMAT = "hybridep-plan/1"


def default_level_names(n_levels: int) -> tuple[str, ...]:
    return {1: ("gpu",), 2: ("dc", "gpu"), 3: ("dc", "node", "gpu")}.get(
        n_levels, tuple(f"level{i}" for i in range(n_levels)))


@dataclass(frozen=True)
class Plan:
    """Expert domains and token rails for one EP group. Equality ignores the predictions.

    Fields:
        kind: "domains" (HybridEP; all domain sizes 1 is Megatron's EP) or "replicated" (EP inside
            each DC, experts replicated across DCs; see the module's docstring).
        level_names, level_counts: the EP group's ranks as a grid, outermost level first (e.g.
            ("dc", "gpu"), (2, 4) for 2 DCs of 4 ranks, Megatron's rank order).
        domain_sizes: S_l per level; a domain's ranks all-gather each other's experts, a rail's
            exchange tokens (their product is S, the ranks per domain).
        num_experts: the MoE layer's expert count (a multiple of the EP size).
        predicted: the cost model's seconds per phase (plan/phases.py names), for logs and the bench.
        link_bytes: the cost model's bytes per link kind per iteration.
        replicas: hot-expert replicas (plan/hot.py), empty for none.
    Build one with ``Plan.grid``, the planner (``choose_plan``) or ``Plan.from_dict`` (the JSON that
    ``hybridep plan --out`` writes); ``validate(ep_size, num_experts)`` checks it against a job.
    """

    kind: str
    level_names: tuple[str, ...]
    level_counts: tuple[int, ...]
    domain_sizes: tuple[int, ...]
    num_experts: int
    predicted: dict[str, float] = field(default_factory=dict, compare=False)
    link_bytes: dict[str, float] = field(default_factory=dict, compare=False)
    replicas: Replicas = field(default_factory=Replicas)

    def __post_init__(self) -> None:
        for name in ("level_names", "level_counts", "domain_sizes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not isinstance(self.replicas, Replicas):
            object.__setattr__(self, "replicas", Replicas(tuple(self.replicas)))
        object.__setattr__(self, "predicted", {str(k): float(v) for k, v in dict(self.predicted).items()})
        object.__setattr__(self, "link_bytes", {str(k): float(v) for k, v in dict(self.link_bytes).items()})
        self._check()

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def grid(cls, level_counts: Sequence[int], domain_sizes: Sequence[int], num_experts: int,
             level_names: Sequence[str] | None = None) -> Plan:
        """Hand-made HybridEP plan, e.g. ``Plan.grid((2, 2), (2, 1), 8)``."""
        names = tuple(level_names) if level_names is not None else default_level_names(len(level_counts))
        return cls("domains", names, tuple(level_counts), tuple(domain_sizes), num_experts)

    @classmethod
    def replicated(cls, level_counts: Sequence[int], num_experts: int,
                   level_names: Sequence[str] | None = None) -> Plan:
        """EP inside each coarsest-level unit (DC), experts replicated across them."""
        counts = tuple(level_counts)
        names = tuple(level_names) if level_names is not None else default_level_names(len(counts))
        return cls("replicated", names, counts, (counts[0],) + (1,) * (len(counts) - 1), num_experts)

    def _check(self) -> None:
        if self.kind == "neighbourhood":  # sim/neighbourhood.py: any p = k/(G-1), overlapping holders
            raise PlanError("plan.kind: 'neighbourhood' plans (p = k/(G-1), sim/neighbourhood.py) are simulated "
                            "only; the dispatcher needs domains that partition the ranks; fix: use kind "
                            "'domains' with each S dividing its level count")
        if self.kind not in KINDS:
            raise PlanError(f"plan.kind: unknown kind {self.kind!r}; fix: use one of {', '.join(KINDS)}")
        n = len(self.level_counts)
        if n == 0:
            raise PlanError("plan.level_counts: empty; fix: give at least one level, e.g. (8,)")
        if len(self.domain_sizes) != n or len(self.level_names) != n:
            raise PlanError(f"plan.domain_sizes/level_names: need one entry per level ({n}), got "
                            f"{len(self.domain_sizes)} domain sizes and {len(self.level_names)} names; "
                            "fix: give S_l and a name for every level")
        if len(set(self.level_names)) != n:
            raise PlanError(f"plan.level_names: duplicate names {self.level_names}; fix: name levels uniquely")
        for i, (c, s) in enumerate(zip(self.level_counts, self.domain_sizes, strict=True)):
            if isinstance(c, bool) or not isinstance(c, int | np.integer) or c < 1:
                raise PlanError(f"plan.level_counts[{i}]: must be a positive integer, got {c!r}")
            if isinstance(s, bool) or not isinstance(s, int | np.integer) or s < 1 or c % s:
                raise PlanError(f"plan.domain_sizes[{i}] ({self.level_names[i]}): S={s!r} must be a positive "
                                f"divisor of the level count {c}; fix: pick one of "
                                f"{[d for d in range(1, c + 1) if c % d == 0]}")
        object.__setattr__(self, "level_counts", tuple(int(c) for c in self.level_counts))
        object.__setattr__(self, "domain_sizes", tuple(int(s) for s in self.domain_sizes))
        E, G = self.num_experts, self.megatron_ep_size
        if isinstance(E, bool) or not isinstance(E, int | np.integer) or E < 1:
            raise PlanError(f"plan.num_experts: must be a positive integer, got {E!r}")
        object.__setattr__(self, "num_experts", int(E))
        if self.kind == "replicated":
            want = (self.level_counts[0],) + (1,) * (n - 1)
            if n < 2 or self.level_counts[0] < 2 or self.domain_sizes != want:
                raise PlanError(f"plan.domain_sizes: a replicated plan needs >= 2 levels with >= 2 units at "
                                f"the coarsest and S = {want}; got counts {self.level_counts}, "
                                f"S {self.domain_sizes}; fix: use Plan.replicated(level_counts, num_experts)")
        if E % G:
            raise PlanError(f"plan.num_experts: {E} experts cannot be split evenly over ep_size={G} ranks; "
                            f"fix: use a number of experts divisible by {G} or a smaller EP size")
        if self.replicas:
            if self.kind != "domains":
                raise PlanError("plan.replicas: hot-expert replicas need a 'domains' plan; fix: drop them or "
                                "use Plan.grid(...).with_replicas(...)")
            self.replicas.check(E, self.ep_size, lambda r: self._domain_held(r), self.owner_of_expert)

    def with_replicas(self, pairs: Sequence[tuple[int, int]], max_per_rank: int | None = None) -> Plan:
        """This plan plus hot-expert replicas ``(expert, ep_rank)`` (predictions are dropped)."""
        return Plan(self.kind, self.level_names, self.level_counts, self.domain_sizes, self.num_experts,
                    replicas=Replicas(tuple(pairs), max_per_rank))

    @property
    def base(self) -> Plan:
        """The same domains and rails without replicas."""
        return self.with_replicas(()) if self.replicas else self

    # ---- sizes ------------------------------------------------------------------------------------
    @property
    def ep_size(self) -> int:
        return math.prod(self.level_counts)

    @property
    def domain_size(self) -> int:
        return math.prod(self.domain_sizes)

    @property
    def borrowed_share(self) -> float:
        """Share of routed tokens computed on borrowed copies under even routing, hot replicas aside:
        a token is computed in one domain, on the copy of one of its S ranks, so 1 - 1/S; 0 for
        Megatron's EP and for replicated experts (Megatron's own copies, exact)."""
        return 1.0 - 1.0 / self.domain_size if self.kind == "domains" else 0.0

    @property
    def rail_size(self) -> int:
        return self.ep_size // self.domain_size

    @property
    def megatron_ep_size(self) -> int:
        """The expert-model-parallel size Megatron itself runs with: the rail for replicated plans."""
        return self.rail_size if self.kind == "replicated" else self.ep_size

    @property
    def experts_per_rank(self) -> int:
        """Experts each rank owns (keeps optimizer state for)."""
        return self.num_experts // self.megatron_ep_size

    @property
    def label(self) -> str:
        if self.kind == "replicated":
            return f"replicated ({self.level_names[0]} x{self.level_counts[0]}, EP={self.rail_size})"
        hot = f" +{len(self.replicas)} hot" if self.replicas else ""
        if self.domain_size == 1:
            return "ep (S=1)" + hot
        return "domains " + " ".join(f"{n}{s}" for n, s in zip(self.level_names, self.domain_sizes, strict=True)) + hot

    # ---- coordinates -------------------------------------------------------------------------------
    def coords(self, rank: int) -> tuple[int, ...]:
        self._check_rank(rank)
        return coords_of(rank, self.level_counts)

    def offset_of(self, rank: int) -> tuple[int, ...]:
        """Position of the rank inside its domain, per level (c_l % S_l)."""
        return tuple(c % s for c, s in zip(self.coords(rank), self.domain_sizes, strict=True))

    def block_of(self, rank: int) -> tuple[int, ...]:
        """Which domain block the rank is in, per level (c_l // S_l)."""
        return tuple(c // s for c, s in zip(self.coords(rank), self.domain_sizes, strict=True))

    def domain_index(self, rank: int) -> int:
        radices = [n // s for n, s in zip(self.level_counts, self.domain_sizes, strict=True)]
        return rank_of(self.block_of(rank), radices)

    def rail_index(self, rank: int) -> int:
        return rank_of(self.offset_of(rank), self.domain_sizes)

    @cached_property
    def _coords(self) -> np.ndarray:
        return coord_array(np.arange(self.ep_size), self.level_counts)

    @cached_property
    def _domain_keys(self) -> np.ndarray:
        radices = tuple(n // s for n, s in zip(self.level_counts, self.domain_sizes, strict=True))
        return np.asarray(np.ravel_multi_index(tuple((self._coords // self.domain_sizes).T), radices))

    @cached_property
    def domains(self) -> tuple[tuple[int, ...], ...]:
        """Expert all-gather groups (for replicated: expert gradient all-reduce groups), by domain index."""
        return group_ranks(self._domain_keys)

    @cached_property
    def rails(self) -> tuple[tuple[int, ...], ...]:
        """Token all-to-all groups, by rail index (= offset inside the domain)."""
        keys = np.ravel_multi_index(tuple((self._coords % self.domain_sizes).T), self.domain_sizes)
        return group_ranks(np.asarray(keys))

    def domain_of(self, rank: int) -> tuple[int, ...]:
        return self.domains[self.domain_index(rank)]

    def rail_of(self, rank: int) -> tuple[int, ...]:
        return self.rails[self.rail_index(rank)]

    # ---- experts -----------------------------------------------------------------------------------
    def owner_of_expert(self, expert: int) -> int:
        """Megatron's contiguous assignment: expert // (E // G). For replicated plans the replica in
        the first DC (every domain member holds an identical replica)."""
        if not 0 <= expert < self.num_experts:
            raise PlanError(f"expert {expert}: out of range; fix: use 0 <= expert < {self.num_experts}")
        return expert // (self.num_experts // self.megatron_ep_size)

    def owned_experts(self, rank: int) -> tuple[int, ...]:
        """Experts this rank keeps master weights and optimizer state for."""
        if self.kind == "replicated":
            return self.held_experts(rank)
        self._check_rank(rank)
        k = self.num_experts // self.ep_size
        return tuple(range(rank * k, (rank + 1) * k))

    def _domain_held(self, rank: int) -> tuple[int, ...]:
        k = self.num_experts // self.megatron_ep_size
        owners = set(self.domain_of(rank))
        return tuple(e for e in range(self.num_experts) if e // k in owners)

    def held_experts(self, rank: int) -> tuple[int, ...]:
        """Experts whose weights this rank holds during the step: owned, borrowed from its domain and
        hot-expert replicas."""
        return tuple(sorted(set(self._domain_held(rank)) | set(self.replicas.experts_on(rank))))

    def compute_rank(self, src_rank: int, expert: int) -> int:
        """Rank that computes src_rank's tokens routed to `expert`: src_rank itself if it holds a
        replica of it, else domain_of(owner) ∩ rail_of(src)."""
        if (expert, src_rank) in self.replicas.pair_set:
            return src_rank
        owner = self.coords(self.owner_of_expert(expert))
        src = self.coords(src_rank)
        return rank_of([(o // s) * s + c % s for o, c, s in zip(owner, src, self.domain_sizes, strict=True)],
                       self.level_counts)

    def compute_ranks(self) -> np.ndarray:
        """compute_rank for every (src_rank, expert), as an int64 array of shape (G, E)."""
        k = self.num_experts // self.megatron_ep_size
        owners = np.arange(self.num_experts) // k
        oc = coord_array(owners, self.level_counts)          # (E, L)
        sc = self._coords                                     # (G, L)
        s = np.asarray(self.domain_sizes)
        c = (oc[None, :, :] // s) * s + sc[:, None, :] % s    # (G, E, L)
        out = (c * np.asarray(place_values(self.level_counts))).sum(-1)
        for e, r in self.replicas.pairs:
            out[r, e] = r
        return out

    # ---- checks ------------------------------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.ep_size:
            raise PlanError(f"rank {rank}: out of range for ep_size={self.ep_size}; "
                            f"fix: use an EP rank 0 <= rank < {self.ep_size}")

    def validate(self, ep_size: int, num_experts: int) -> None:
        """Check the plan against the job's EP size and expert count (e.g. Megatron's args)."""
        G = self.megatron_ep_size
        if ep_size != G:
            what = "rail size (Megatron's EP inside each DC)" if self.kind == "replicated" else "EP group size"
            raise PlanError(f"plan.level_counts: the plan's {what} is {G} ({'x'.join(map(str, self.level_counts))})"
                            f" but the job runs expert_model_parallel_size={ep_size}; fix: regenerate the "
                            f"plan with 'hybridep plan --ep-size {ep_size}' or set "
                            f"--expert-model-parallel-size {G}")
        if num_experts != self.num_experts:
            raise PlanError(f"plan.num_experts: the plan was made for {self.num_experts} experts but the model "
                            f"has {num_experts}; fix: regenerate the plan with the model's config")

    # ---- serialisation -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Everything a reader needs, including each rank's domain/offset (derived, checked on load)."""
        return {
            "format": FORMAT,
            "kind": self.kind,
            "level_names": list(self.level_names),
            "level_counts": list(self.level_counts),
            "domain_sizes": list(self.domain_sizes),
            "num_experts": self.num_experts,
            "ep_size": self.ep_size,
            "predicted": dict(self.predicted),
            "link_bytes": dict(self.link_bytes),
            "domains": [list(d) for d in self.domains],
            "rails": [list(r) for r in self.rails],
            "ranks": [{"rank": r, "coords": c, "domain": d, "offset": o} for r, (c, d, o) in enumerate(zip(
                self._coords.tolist(), self._domain_keys.tolist(), (self._coords % self.domain_sizes).tolist(),
                strict=True))],
            **({"replicas": self.replicas.to_dict()} if self.replicas else {}),
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: Any, source: str = "plan") -> Plan:
        if not isinstance(d, dict):
            raise PlanError(f"{source}: expected a JSON object; fix: pass a file written by 'hybridep plan --out'")
        if d.get("format") != FORMAT:
            raise PlanError(f"{source}.format: expected {FORMAT!r}, got {d.get('format')!r}; "
                            "fix: regenerate the plan with 'hybridep plan --out'")
        try:
            replicas = Replicas.from_dict(d.get("replicas"), f"{source}.replicas")
            plan = cls(d["kind"], tuple(d["level_names"]), tuple(d["level_counts"]), tuple(d["domain_sizes"]),
                       d["num_experts"], d.get("predicted", {}), d.get("link_bytes", {}), replicas)
        except KeyError as exc:
            raise PlanError(f"{source}.{exc.args[0]}: missing; fix: regenerate the plan with "
                            "'hybridep plan --out'") from None
        except TypeError as exc:  # e.g. level_counts: 5 (not a list)
            raise PlanError(f"{source}: {_first_bad_list(d)} ({exc}); fix: regenerate the plan with "
                            "'hybridep plan --out'") from None
        for key, derived in (("domains", plan.domains), ("rails", plan.rails)):
            if key in d and not (isinstance(d[key], list) and all(isinstance(g, list) for g in d[key])):
                raise PlanError(f"{source}.{key}: expected a list of rank lists; fix: regenerate the plan")
            if key in d and [tuple(g) for g in d[key]] != list(derived):
                raise PlanError(f"{source}.{key}: does not match level_counts/domain_sizes; fix: edit only "
                                "kind, level_counts and domain_sizes, or regenerate the plan")
        return plan

    @classmethod
    def from_json(cls, s: str, source: str = "plan") -> Plan:
        try:
            d = json.loads(s)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{source}: not valid JSON ({exc}); fix: regenerate with 'hybridep plan --out'") from None
        return cls.from_dict(d, source)

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> Plan:
        try:
            with open(path, encoding="utf-8") as f:
                return cls.from_json(f.read(), source=path)
        except FileNotFoundError:
            raise PlanError(f"{path}: plan file not found; fix: create it with "
                            "'hybridep plan ... --out PATH'") from None


def _first_bad_list(d: dict) -> str:
    """The first of a plan's list fields that is not a list (for a message naming the field)."""
    for key in ("level_names", "level_counts", "domain_sizes"):
        if not isinstance(d.get(key), list):
            return f"{key}: expected a list, got {d.get(key)!r}"
    for key in ("predicted", "link_bytes"):
        if key in d and not isinstance(d[key], dict):
            return f"{key}: expected a mapping, got {d[key]!r}"
    return "a malformed field"
