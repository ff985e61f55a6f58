"""Tier (a): the paper's stream model as published (HybridEP, arXiv 2510.19470, section III).

Per MoE layer, forward, at one level with G ranks, link bandwidth B, dispatched bytes D per rank,
expert bytes P per rank and compute T_pre before the experts, with p the fraction of token traffic
still sent by all-to-all (p = 1 - S/G):

    T(p) = max(T_pre, (1 - p)(G - 1) P / B) + 2 p (G - 1) D / (G B)

T is piecewise linear in p, so its minimum is at a kink or an end:
- 2D >= G P:  p* = 0 (moving every expert is cheaper than any token traffic);
- otherwise   p* = max(0, 1 - B T_pre / ((G - 1) P)) (gather exactly what T_pre hides).
A plan needs S = G (1 - p) to divide G: the continuous S* is rounded to the neighbouring divisor with
the smaller T(p) (T is convex, so one of the two neighbours is the best divisor).

As published p is continuous: at S = 1 (plain EP, p = 1 - 1/G) the formula still charges 1/G of the
gather and (1 - 1/G) of EP's token bytes. We keep it exactly; tier (b) counts the real bytes.

The paper states the model for one level. With several levels we apply it per level and combine
them as ours: T = max(T_pre, sum of the levels' gathers) + sum of the levels' all-to-alls, which is
the paper's formula when there is one level. No latency, no backward pass, balanced routing,
no contention: that is what tier (b) adds.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_hybridep.plan.cost import CostBreakdown, LevelBreakdown
from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.grid import divisors
from megatron_hybridep.plan.phases import Phase
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.topology import EPLayout, Topology
from megatron_hybridep.plan.workload import Workload

MOVE_ALL = "2D >= G*P: p*=0, move all experts"
BALANCE = "p* = 1 - B*T_pre/((G-1)P)"
CLAMPED = "1 - B*T_pre/((G-1)P) <= 0: p*=0, the gather hides behind T_pre"
SINGLE = "G = 1: nothing to exchange"


@dataclass(frozen=True)
class StreamTime:
    ag: float        # (1 - p)(G - 1) P / B
    a2a: float       # 2 p (G - 1) D / (G B), dispatch + combine
    total: float     # max(T_pre, ag) + a2a


def stream_time(p: float, G: int, D: float, P: float, B: float, t_pre: float) -> StreamTime:
    """The paper's T(p) for one level, forward, one MoE layer."""
    if not 0.0 <= p <= 1.0:
        raise PlanError(f"p: the all-to-all fraction must lie in [0, 1], got {p}")
    ag = (1.0 - p) * (G - 1) * P / B
    a2a = 2.0 * p * (G - 1) * D / (G * B)
    return StreamTime(ag, a2a, max(t_pre, ag) + a2a)


def optimal_p(G: int, D: float, P: float, B: float, t_pre: float) -> tuple[float, str]:
    """The closed form p* and which case produced it."""
    if G <= 1:
        return 0.0, SINGLE
    if 2.0 * D >= G * P:
        return 0.0, MOVE_ALL
    p = 1.0 - B * t_pre / ((G - 1) * P)
    if p <= 0.0:
        return 0.0, CLAMPED
    return p, BALANCE


def round_domain_size(p: float, G: int, D: float, P: float, B: float, t_pre: float) -> int:
    """The feasible S (a divisor of G) next to S* = G (1 - p) with the smaller T; ties -> smaller S."""
    ds = divisors(G)
    s_star = G * (1.0 - p)
    i = bisect.bisect_left(ds, s_star)
    near = {ds[max(i - 1, 0)], ds[min(i, len(ds) - 1)]}
    return min(near, key=lambda s: (stream_time(1.0 - s / G, G, D, P, B, t_pre).total, s))


@dataclass(frozen=True)
class PaperLevel:
    name: str
    G: int
    bandwidth: float        # bytes/s
    case: str
    p_star: float
    s_star: float           # G (1 - p*), before rounding
    s: int                  # feasible domain size
    p: float                # 1 - s / G
    ag: float
    a2a: float


@dataclass(frozen=True)
class PaperResult:
    D: float
    P: float
    t_pre: float
    levels: tuple[PaperLevel, ...]
    layer_time: float        # forward, one MoE layer

    @property
    def domain_sizes(self) -> tuple[int, ...]:
        return tuple(lv.s for lv in self.levels)


class PaperModel:
    """The paper's model on an EP group: per-level closed forms and plan evaluation (forward only)."""

    name = "paper"

    def __init__(self, topology: Topology, workload: Workload) -> None:
        self.topology = topology
        self.workload = workload

    def _inputs(self, lay: EPLayout) -> tuple[float, float, float]:
        w = self.workload
        D = w.dispatch_bytes
        P = (w.num_experts // lay.ep_size) * w.expert_wire_bytes
        return D, P, w.t_pre

    def _bandwidths(self, lay: EPLayout) -> list[float]:
        return [self.topology.levels[lvl].bandwidth for lvl in lay.levels]

    def combine(self, lay: EPLayout, domain_sizes: Sequence[int]) -> tuple[float, list[StreamTime]]:
        D, P, t_pre = self._inputs(lay)
        times = [stream_time(1.0 - s / n, n, D, P, B, 0.0)
                 for n, s, B in zip(lay.counts, domain_sizes, self._bandwidths(lay), strict=True)]
        return max(t_pre, sum(t.ag for t in times)) + sum(t.a2a for t in times), times

    def optimum(self, ep_size: int) -> PaperResult:
        """The paper's choice: closed-form p* per level, rounded to a feasible S."""
        lay = self.topology.ep_layout(ep_size)
        D, P, t_pre = self._inputs(lay)
        levels = []
        for name, n, B in zip(lay.names, lay.counts, self._bandwidths(lay), strict=True):
            p_star, case = optimal_p(n, D, P, B, t_pre)
            s = round_domain_size(p_star, n, D, P, B, t_pre) if n > 1 else 1
            st = stream_time(1.0 - s / n, n, D, P, B, t_pre)
            levels.append(PaperLevel(name, n, B, case, p_star, n * (1 - p_star), s, 1.0 - s / n, st.ag, st.a2a))
        total, _ = self.combine(lay, [lv.s for lv in levels])
        return PaperResult(D, P, t_pre, tuple(levels), total)

    def evaluate(self, plan: Plan) -> CostBreakdown:
        """Forward time per iteration of a domains plan under the paper's model."""
        if plan.kind != "domains":
            raise PlanError("cost model 'paper' covers domain plans only; fix: use the 'ours' cost model "
                            "to compare with the replicated plan")
        lay = self.topology.ep_layout(plan.ep_size)
        if plan.level_counts != lay.counts:
            raise PlanError(f"plan.level_counts: {plan.level_counts} do not match the EP group's {lay.counts}")
        w = self.workload
        layer, times = self.combine(lay, plan.domain_sizes)
        ag, a2a = sum(t.ag for t in times), sum(t.a2a for t in times)
        Lm, m = w.num_moe_layers, w.micro_batches
        phases = {Phase.PRE_COMPUTE: w.t_pre * Lm * m, Phase.EXPERT_ALLGATHER: Lm * max(0.0, ag - w.t_pre),
                  Phase.TOKEN_A2A_FWD: Lm * m * a2a}
        levels = tuple(
            LevelBreakdown(name, 0.0, 0.0, {Phase.EXPERT_ALLGATHER: t.ag * Lm, Phase.TOKEN_A2A: t.a2a * Lm * m})
            for name, t in zip(lay.names, times, strict=True))
        raw = {"t_pre": w.t_pre, Phase.EXPERT_ALLGATHER: ag, "a2a": a2a / 2, "layer_forward": layer}
        return CostBreakdown("paper", sum(phases.values()), phases, raw, levels, None,
                             ("paper model: forward only, no latency, no contention, balanced routing",))
