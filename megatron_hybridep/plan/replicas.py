"""Hot-expert replicas carried by a Plan: which ranks hold a copy of which (hot) expert.

A replica ``(expert, rank)`` means: ``rank`` receives the owner's weights of ``expert`` every step and
computes its *own* tokens for that expert locally (they never travel); the gradient of the copy
returns to the owner. Everything else follows the plan's domains and rails. Chosen by plan/hot.py
from routing counts; executed by runtime/replication.py. Pure Python: no numpy needed here.

JSON (inside a plan): ``"replicas": {"pairs": [[expert, ep_rank], ...], "max_per_rank": 2}``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from megatron_hybridep.plan.errors import PlanError


@dataclass(frozen=True)
class Replicas:
    pairs: tuple[tuple[int, int], ...] = ()     # (expert, EP-local rank), sorted
    max_per_rank: int | None = None             # memory budget: expert copies per rank (per MoE layer)

    def __post_init__(self) -> None:
        pairs = []
        for i, p in enumerate(self.pairs):
            if (not isinstance(p, Sequence) or len(p) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in p)):
                raise PlanError(f"plan.replicas.pairs[{i}]: expected [expert, ep_rank] integers, got {p!r}; "
                                "fix: list pairs like [[3, 2], [3, 3]]")
            pairs.append((int(p[0]), int(p[1])))
        object.__setattr__(self, "pairs", tuple(sorted(pairs)))
        m = self.max_per_rank
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise PlanError(f"plan.replicas.max_per_rank: must be an integer >= 0 or null, got {m!r}; "
                            "fix: the number of expert copies a rank may hold")

    def __len__(self) -> int:
        return len(self.pairs)

    def __bool__(self) -> bool:
        return bool(self.pairs)

    @cached_property
    def pair_set(self) -> frozenset[tuple[int, int]]:
        return frozenset(self.pairs)

    def experts_on(self, rank: int) -> tuple[int, ...]:
        """Experts this rank holds replicas of, ascending."""
        return tuple(e for e, r in self.pairs if r == rank)

    def per_rank(self) -> Counter[int]:
        return Counter(r for _, r in self.pairs)

    def check(self, num_experts: int, ep_size: int, held: Callable[[int], Sequence[int]],
              owner: Callable[[int], int]) -> None:
        """Every failure names the pair and the fix (called by Plan, before any collective)."""
        seen = set()
        for e, r in self.pairs:
            where = f"plan.replicas: pair [{e}, {r}]"
            if not 0 <= e < num_experts:
                raise PlanError(f"{where}: expert {e} out of range; fix: use 0 <= expert < {num_experts}")
            if not 0 <= r < ep_size:
                raise PlanError(f"{where}: rank {r} out of range; fix: use an EP rank 0 <= rank < {ep_size}")
            if (e, r) in seen:
                raise PlanError(f"{where}: listed twice; fix: list each (expert, rank) once")
            seen.add((e, r))
            if e in held(r):
                what = "its owner" if owner(e) == r else "a rank whose domain already holds it"
                raise PlanError(f"{where}: rank {r} is {what} (owner: rank {owner(e)}); fix: replicate only "
                                "onto ranks outside the expert's domain")
        if self.max_per_rank is not None:
            for r, n in sorted(self.per_rank().items()):
                if n > self.max_per_rank:
                    raise PlanError(f"plan.replicas: rank {r} holds {n} replicas, over the budget max_per_rank="
                                    f"{self.max_per_rank}; fix: drop replicas or raise the budget")

    def to_dict(self) -> dict[str, Any]:
        return {"pairs": [list(p) for p in self.pairs], "max_per_rank": self.max_per_rank}

    @classmethod
    def from_dict(cls, d: Any, source: str = "plan.replicas") -> Replicas:
        if d is None:
            return cls()
        if not isinstance(d, dict) or not isinstance(d.get("pairs"), list):
            raise PlanError(f"{source}: expected {{\"pairs\": [[expert, rank], ...], \"max_per_rank\": N}}, got "
                            f"{d!r}; fix: regenerate the plan with 'hybridep plan --out'")
        unknown = set(d) - {"pairs", "max_per_rank"}
        if unknown:
            raise PlanError(f"{source}.{sorted(unknown)[0]}: unknown key; fix: only pairs and max_per_rank")
        return cls(tuple(tuple(p) if isinstance(p, list) else p for p in d["pairs"]), d.get("max_per_rank"))
