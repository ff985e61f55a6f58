"""The expert-placement scheduler: keeps the plan right while training.

Every ``interval`` iterations it turns the runtime's measurements into cost-model inputs —
per-expert routing counts (from the router), effective bandwidth per link level (bytes / seconds of
the blocking token all-to-alls and gradient returns, smoothed), and the step time — and asks
``plan.planner.replan`` whether another prebuilt plan beats the current one by more than the
switch cost over the horizon. It switches only after ``patience`` consecutive checks agree
(hysteresis, so it cannot flap), at an iteration boundary, identically on every rank (the inputs
are all-reduced first, and the decision is a pure function of them).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from megatron_hybridep.plan.planner import Replan, replan
from megatron_hybridep.plan.topology import Level, Topology
from megatron_hybridep.plan.workload import Workload
from megatron_hybridep.runtime.context import HybridEPRuntime

log = logging.getLogger("hybridep.scheduler")

BLOCKING_PHASES = ("token_dispatch", "token_combine", "grad_return")


@dataclass(frozen=True)
class SchedulerConfig:
    interval: int = 10        # iterations between decisions
    horizon: int = 100        # iterations the predicted gain is counted over
    patience: int = 2         # consecutive decisions that must agree before a switch
    smoothing: float = 0.5    # weight of the newest measurement in the moving averages
    min_bytes: float = 64e3   # below this many bytes per interval a level's bandwidth is not re-estimated


@dataclass(frozen=True)
class Measurement:
    """What one interval measured, identical on every rank (after all-reduce)."""

    routing: np.ndarray                 # (G, E) tokens from each EP rank to each expert, per MoE layer
    level_bytes: dict[str, float]       # bytes of blocking collectives per link level (summed over ranks)
    level_seconds: dict[str, float]     # their time (max over ranks)


@dataclass
class Decision:
    iteration: int
    replan: Replan
    switched: bool
    bandwidth_gbps: dict[str, float]


@dataclass
class PlanScheduler:
    runtime: HybridEPRuntime
    topology: Topology                  # of the EP group, as configured (measured bandwidth replaces it)
    workload: Workload
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    bandwidth_gbps: dict[str, float] = field(default_factory=dict)
    routing: np.ndarray | None = None
    history: list[Decision] = field(default_factory=list)
    _streak: tuple[int, int] = (-1, 0)  # (candidate plan index, consecutive agreeing checks)

    # ---- measurement ---------------------------------------------------------------------------
    def measure(self) -> Measurement:
        """All-reduce this interval's statistics so every rank decides on the same numbers."""
        stats, plan = self.runtime.stats, self.runtime.plan
        g, e = plan.ep_size, plan.num_experts
        routing = np.zeros((g, e))
        if stats.tokens_per_expert:
            routing[self.runtime.active_groups.ep_rank] = sum(stats.tokens_per_expert.values()) / max(
                1, len(stats.tokens_per_expert))
        levels = list(self.topology.level_names)
        nbytes = [float(sum(stats.bytes_by(phase=p, level=lv) for p in BLOCKING_PHASES)) for lv in levels]
        secs = [float(sum(stats.seconds_by(phase=p) for p in BLOCKING_PHASES))] * len(levels)
        t_sum = torch.tensor(np.concatenate([routing.ravel(), nbytes]), dtype=torch.float64)
        t_max = torch.tensor(secs, dtype=torch.float64)
        group = self.runtime.ep_group
        dist.all_reduce(t_sum, group=group)
        dist.all_reduce(t_max, op=dist.ReduceOp.MAX, group=group)
        flat = t_sum.numpy()  # the caller (training log) resets the stats once per iteration
        return Measurement(flat[: g * e].reshape(g, e), dict(zip(levels, flat[g * e:].tolist(), strict=True)),
                           dict(zip(levels, t_max.numpy().tolist(), strict=True)))

    # ---- decision (pure: same inputs, same answer on every rank) -----------------------------
    def update_estimates(self, m: Measurement) -> None:
        a = self.config.smoothing
        if m.routing.sum() > 0:
            self.routing = m.routing if self.routing is None else a * m.routing + (1 - a) * self.routing
        for name, nbytes in m.level_bytes.items():
            secs = m.level_seconds.get(name, 0.0)
            if nbytes >= self.config.min_bytes and secs > 0:
                # Bytes summed over ranks crossed the level's links in parallel; per-rank rate.
                per_rank = nbytes / self.runtime.plan.ep_size
                gbps = per_rank * 8 / secs / 1e9
                old = self.bandwidth_gbps.get(name)
                self.bandwidth_gbps[name] = gbps if old is None else a * gbps + (1 - a) * old

    def measured_topology(self) -> Topology:
        levels = tuple(dataclasses.replace(lv, bandwidth_gbps=self.bandwidth_gbps.get(lv.name, lv.bandwidth_gbps),
                                           uplink_gbps=None if lv.name in self.bandwidth_gbps else lv.uplink_gbps)
                       if isinstance(lv, Level) else lv for lv in self.topology.levels)
        return Topology(levels, self.topology.name, self.topology.description, source="measured")

    def decide(self, iteration: int) -> Decision:
        workload = self.workload if self.routing is None else self.workload.replace(
            routing_counts=np.rint(self.routing).astype(np.int64))
        r = replan(self.measured_topology(), workload, self.runtime.plan, horizon_iterations=self.config.horizon,
                   candidates=self.runtime.plans)
        switched = False
        if r.switch:
            index = self.runtime.plans.index(r.plan)
            streak = self._streak[1] + 1 if self._streak[0] == index else 1
            self._streak = (index, streak)
            if streak >= self.config.patience:
                say = log.warning if not dist.is_initialized() or dist.get_rank() == 0 else log.debug
                say("hybridep scheduler, iteration %d: switching %s -> %s (%s; predicted %.4g s -> %.4g s "
                            "per iteration; measured bandwidth %s)", iteration, self.runtime.plan.label,
                            r.plan.label, r.reason, r.current_seconds, r.best_seconds,
                            {k: round(v, 3) for k, v in self.bandwidth_gbps.items()})
                self.runtime.switch(index)
                self._streak = (-1, 0)
                switched = True
        else:
            self._streak = (-1, 0)
        d = Decision(iteration, r, switched, dict(self.bandwidth_gbps))
        self.history.append(d)
        return d

    def step(self, iteration: int) -> Decision | None:
        """Call after every optimizer step (all ranks)."""
        if iteration % self.config.interval:
            return None
        self.update_estimates(self.measure())
        return self.decide(iteration)
