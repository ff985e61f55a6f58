"""The expert-placement scheduler: keeps the plan right while training.

Every ``interval`` iterations it turns the runtime's measurements into cost-model inputs —
per-expert routing counts (from the router), the effective bandwidth per link level, and the compute
per iteration (wall time minus every timed collective, the dense gradient all-reduce the training
loop records with ``Stats.timed("dense_grad_allreduce")`` included; it sets the cost model's compute
speed, while tier b prices the dense all-reduce itself from bandwidth) — and asks
``plan.planner.replan`` whether another prebuilt plan beats the current one by more than the switch
cost over the horizon. It switches only after ``patience`` consecutive checks agree and only for a
gain of at least ``min_gain`` of the current step (hysteresis, so it cannot flap), at an iteration
boundary, identically on every rank (one all-reduce; the decision is a pure function of it). The
all-reduce runs in the background during the next iteration (``overlap``): a decision at iteration i
uses iteration i-1's numbers, so the scheduler never waits for the slowest rank or the WAN.

Bandwidth of a level = bytes / seconds of the blocking collectives (token all-to-alls both ways,
gradient returns) whose coarsest link is that level: a call that crosses the WAN is timed as WAN
traffic, its intra-DC bytes travel in parallel. The seconds are the *minimum* over ranks: a blocking
collective on the rank that arrives last has no peer to wait for, so its time is transfer time, not
the compute skew the early ranks spend waiting (which made small transfers look 2-5x slower than the
link, and a straggler rank made every link look slow). The price: its peers' bytes were already
moving when it arrived, so a long call under skew reads fast (the 20 Mbit/s replan demo: 0-15%).
Compute is the same rank's view: the slowest rank's iteration minus its collectives. Calls shorter
than ``min_call_s`` are overhead-bound (on a busy CPU gloo spends ~10 ms per call whatever the link),
so such a sample stands for the configured rate, not a measured one. Each level's estimate is the
median of its last ``window`` samples: one outlier never moves it, and a real change (a WAN rate
drop) is adopted after ``window // 2 + 1`` samples. Last, every level is scaled by one factor so that
the running plan's modelled communication equals its measured one (``_fitted``): the other plans are
priced with the same network.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_hybridep.plan.cost import CostModel
from megatron_hybridep.plan.phases import BLOCKING, Phase
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.planner import Replan, replan, with_hot_plans
from megatron_hybridep.plan.topology import Level, Topology
from megatron_hybridep.plan.workload import Workload
from megatron_hybridep.runtime.context import HybridEPRuntime
from megatron_hybridep.runtime.instrument import Stats
from megatron_hybridep.runtime.logs import warn_once

log = logging.getLogger("hybridep.scheduler")

BLOCKING_PHASES = BLOCKING
HISTORY = 100  # decisions PlanScheduler.history keeps


@dataclass(frozen=True)
class SchedulerConfig:
    interval: int = 10        # iterations between decisions (each measures its last iteration)
    horizon: int = 100        # iterations the predicted gain is counted over
    patience: int = 2         # consecutive decisions that must agree before a switch
    smoothing: float = 0.5    # weight of the newest routing measurement in its moving average
    window: int = 3           # bandwidth estimate = median of a level's last `window` samples; no switch
                              # before every measured level has `window` samples
    min_gain: float = 0.05    # switch only when the best plan is predicted this fraction faster per step
                              # (of a measured-compute step: 10% missed a measured 13-15% gain on the testbed)
    warmup: int = 3           # first iterations not measured (allocation, first gathers: 1.5-2x slower)
    recost_tolerance: float = 0.10  # re-run the cost model only when an input moved by more than this
    min_bytes: float = 64e3   # below this many bytes per interval a level's bandwidth is not re-estimated
    min_call_s: float = 0.04  # calls faster than this are overhead-bound (gloo on a busy CPU: 10-30 ms per
                              # call): such a sample says "as fast as configured", not a rate
    overlap: bool = True      # all-reduce the statistics in the background; decide one iteration later
    replica_budget: int | None = 0  # hot-expert replicas per rank the scheduler may add to a prebuilt plan
                                    # (None: the experts a rank owns; 0: off, only prebuilt plans)
    cycle_every: int = 0      # diagnostic (benchmarks/soak.py, no flag): instead of deciding by cost, switch
                              # to the next candidate plan at every multiple of this many iterations


@dataclass(frozen=True)
class Measurement:
    """What one interval measured, identical on every rank (after all-reduce)."""

    routing: np.ndarray                 # (G, E) tokens from each EP rank to each expert, per MoE layer
    level_bytes: dict[str, float]       # bytes of blocking collectives timed at each level (summed over ranks)
    level_seconds: dict[str, float]     # their time (min over ranks: transfer without waiting for peers)
    level_calls: dict[str, float] | None = None  # how many calls that was (None: one)
    compute_s: float = 0.0              # the iteration minus its timed collectives, slowest rank (0: unknown)
    iteration_s: float = 0.0            # the iteration's wall time, slowest rank (0: unknown)


def blocking_by_level(stats: Stats, levels: tuple[str, ...]) -> tuple[list[float], list[float], list[float]]:
    """(bytes, seconds, calls) per level (coarsest first) of this rank's blocking collectives, each
    call counted at the coarsest level it sends bytes over: its time is set by that (slowest) link."""
    nbytes, secs, ncalls = [0.0] * len(levels), [0.0] * len(levels), [0.0] * len(levels)
    calls: dict[tuple[int, str, str], dict[str, float]] = {}
    for (layer, phase, group, level), r in stats.records.items():
        if phase in BLOCKING_PHASES:
            c = calls.setdefault((layer, phase, group), {})
            c[level] = c.get(level, 0.0) + (r.seconds if level == "all" else r.bytes)
            if level == "all":
                c["calls"] = c.get("calls", 0.0) + r.calls
    for c in calls.values():
        i = next((i for i, lv in enumerate(levels) if c.get(lv, 0.0) > 0), None)
        if i is not None:
            nbytes[i] += c[levels[i]]
            secs[i] += c.get("all", 0.0)
            ncalls[i] += c.get("calls", 0.0)
    return nbytes, secs, ncalls


@dataclass
class Decision:
    iteration: int
    replan: Replan
    switched: bool
    bandwidth_gbps: dict[str, float]
    compute_s: float | None = None      # measured compute per iteration the decision used
    network_factor: float = 1.0         # measured / modelled communication of the running plan (_fitted)


@dataclass
class PlanScheduler:
    runtime: HybridEPRuntime
    topology: Topology                  # of the EP group, as configured (measured bandwidth replaces it)
    workload: Workload
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    bandwidth_gbps: dict[str, float] = field(default_factory=dict)
    routing: np.ndarray | None = None
    # the last decisions (for tests and debugging): bounded, a long run decides every `interval` iterations
    history: deque[Decision] = field(default_factory=lambda: deque(maxlen=HISTORY))
    _streak: int = 0                    # consecutive checks that want to switch
    _samples: dict[str, list[float]] = field(default_factory=dict)  # per level, the last `window` rates
    _cache: tuple | None = None         # (inputs, Replan) of the last cost-model run
    _pending: tuple | None = None       # the statistics all-reduce in flight (overlap)
    compute_s: float | None = None      # measured compute per iteration (median of the window); None: not yet
    _compute: list[float] = field(default_factory=list)
    iteration_s: float | None = None    # measured wall time per iteration (median of the window)
    _iteration: list[float] = field(default_factory=list)
    network_factor: float = 1.0         # of the last cost-model run
    _tick: float | None = None          # perf_counter at the previous step(): an iteration's wall time

    def __post_init__(self) -> None:
        # per-rank rate of each level as configured: what an overhead-bound sample stands for
        self._configured = {lv.name: per_rank_gbps(self.topology, i) for i, lv in enumerate(self.topology.levels)}

    # ---- measurement ---------------------------------------------------------------------------
    def measure(self, iteration_s: float = 0.0) -> Measurement:
        """This interval's statistics, all-reduced (blocking)."""
        return self._finish(self._launch(iteration_s))

    def _launch(self, iteration_s: float = 0.0) -> tuple:
        """Start one MIN all-reduce of this interval's statistics so every rank decides on the same
        numbers: per-rank rows (routing, bytes, seconds, calls, compute) are +inf on the other ranks, so
        MIN gathers them. The tensor is built now: the stats may be reset after."""
        stats, plan = self.runtime.stats, self.runtime.plan
        g, e = plan.ep_size, plan.num_experts
        levels = tuple(self.topology.level_names)
        me = self.runtime.active_groups.ep_rank
        nl = len(levels)
        rows = np.full((g, e + 3 * nl + 2), np.inf)
        rows[me, :e] = (sum(stats.tokens_per_expert.values()) / len(stats.tokens_per_expert)
                        if stats.tokens_per_expert else 0.0)
        nbytes, secs, ncalls = blocking_by_level(stats, levels)
        rows[me, e:-2] = nbytes + secs + ncalls
        # compute = the iteration's wall time minus what this rank spent in timed collectives (the dense
        # gradient all-reduce included: tier b prices it as its own phase): calibrates the cost model's
        # compute (everything it does not model, every plan pays alike, lands here too)
        comm = stats.seconds_by()  # per-level records carry bytes only: each call's time counts once
        rows[me, -2:] = (max(0.0, iteration_s - comm) if iteration_s > 0 else 0.0, iteration_s)
        t = torch.from_numpy(rows.ravel())
        if dist.get_backend(self.runtime.ep_group) == "nccl":  # NCCL reduces device tensors only
            t = t.cuda()
        work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.runtime.ep_group, async_op=True)
        return work, t, g, e, levels

    @staticmethod
    def _finish(pending: tuple) -> Measurement:
        work, t, g, e, levels = pending
        work.wait()
        nl = len(levels)
        rows = t.cpu().numpy().reshape(g, e + 3 * nl + 2)
        per_level = lambda a: dict(zip(levels, a.tolist(), strict=True))  # noqa: E731
        nbytes, secs, calls = (rows[:, e + i * nl:e + (i + 1) * nl] for i in range(3))
        return Measurement(rows[:, :e].copy(), per_level(nbytes.sum(axis=0)), per_level(secs.min(axis=0)),
                           per_level(calls.max(axis=0)), float(rows[:, -2].max()), float(rows[:, -1].max()))

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
                calls = max(1.0, (m.level_calls or {}).get(name, 1.0))
                fast = secs / calls < self.config.min_call_s and name in self._configured
                rate = self._configured[name] if fast else per_rank * 8 / secs / 1e9
                self.bandwidth_gbps[name] = self._windowed(self._samples.setdefault(name, []), rate)
        if m.compute_s > 0:
            self.compute_s = self._windowed(self._compute, m.compute_s)
        if m.iteration_s > 0:
            self.iteration_s = self._windowed(self._iteration, m.iteration_s)

    def _windowed(self, samples: list[float], value: float) -> float:
        """Add a sample, keep the last `window`, return their median."""
        samples.append(value)
        del samples[:-self.config.window]
        return float(np.median(samples))

    def measured_topology(self) -> Topology:
        """The configured topology with each measured level scaled by measured / configured per-rank
        rate, its uplink included: the measurement is one rank's share when all ranks of its unit send
        (2 ranks of a DC behind one uplink get half each), while a one-flow-per-uplink collective (the
        dense ring all-reduce, a gather) gets the whole uplink: replacing the level by the per-rank
        rate priced those at half the link (the replan demo predicted +64-105% at 20 Mbit/s)."""
        levels = tuple(_faster(lv, self.bandwidth_gbps[lv.name] / self._configured[lv.name])
                       if lv.name in self.bandwidth_gbps else lv for lv in self.topology.levels)
        return dataclasses.replace(self.topology, levels=levels, source="measured")

    def _costed(self) -> Replan:
        """replan() on the current estimates, or its last answer while no input (bandwidth per level,
        routing per expert) moved by more than recost_tolerance and the plan is the same: the cost
        model is most of the scheduler's time, and steady estimates give the same answer."""
        bw = dict(self.bandwidth_gbps)
        if self.compute_s:
            bw["compute"] = self.compute_s  # inputs like the others (same tolerance)
        if self.iteration_s:
            bw["iteration"] = self.iteration_s
        inputs = (self.runtime.active, bw, None if self.routing is None else self.routing.copy())
        if self._cache is not None and _close(self._cache[0], inputs, self.config.recost_tolerance):
            return self._cache[1]
        workload = self.workload if self.routing is None else self.workload.replace(
            routing_counts=np.rint(self.routing).astype(np.int64))
        topology = self.measured_topology()
        if self.compute_s:
            workload = calibrated(topology, workload, self.runtime.plan, self.compute_s)
            topology = self._fitted(topology, workload)
        r = replan(topology, workload, self.runtime.plan, horizon_iterations=self.config.horizon,
                   candidates=self.candidates(CostModel(topology, workload)))
        self._cache = (inputs, r)
        return r

    def _fitted(self, topology: Topology, workload: Workload) -> Topology:
        """Every level's rates divided by measured / modelled communication of the running plan (the
        slowest rank's iteration minus its compute, against the cost model's exposed communication at
        the measured rates): the per-level rates come from the blocking calls alone and the minimum
        over ranks reads them fast under skew, while gloo's ring all-reduce and gathers run below the
        model's rate (the 20 Mbit/s replan demo: 13-18% under-predicted without it). Refitted once
        the running plan has a full window of step times (after a switch, the factor the switch was
        decided with stays until then); 1 while the measured or the modelled communication is
        overhead-bound (< 2 x min_call_s, < min_call_s): a ratio of two noises."""
        if self.iteration_s and len(self._iteration) >= self.config.window:
            measured, f = self.iteration_s - (self.compute_s or 0.0), 1.0
            if measured >= 2 * self.config.min_call_s:
                for i in range(4):  # fixed point: exposed time is not linear in the rates (overlap)
                    modelled = _exposed_comm(_scaled(topology, f), workload, self.runtime.plan)
                    if (i == 0 and modelled < self.config.min_call_s) or abs(modelled / measured - 1) < 1e-3:
                        break
                    f *= measured / modelled
            self.network_factor = f
        return _scaled(topology, self.network_factor)

    def plans_renumbered(self) -> None:
        """The runtime forgot an adopted plan: the cached answer is keyed by the running plan's index."""
        self._cache = None

    def candidates(self, model: CostModel) -> list[Plan]:
        """The prebuilt plans, plus a hot-replica variant of each plan without replicas once routing
        is measured and skewed (plan/hot.py): it needs no new group, so it is adopted on a switch."""
        if self.config.replica_budget == 0:
            return list(self.runtime.plans)
        bases = [p for p in self.runtime.plans if not p.replicas]
        hot = with_hot_plans(model, bases, self.config.replica_budget)[len(bases):]
        return list(self.runtime.plans) + [p for p in hot if p not in self.runtime.plans]

    def _cycled(self, iteration: int, r: Replan) -> Replan:
        """cycle_every: at every multiple of it, a prebuilt plan's hot variant after the plan itself (when
        routing yields one), else the next prebuilt plan; no switch in between."""
        if iteration % self.config.cycle_every:
            return dataclasses.replace(r, switch=False, plan=self.runtime.plan, reason="cycle: not due")
        current, prebuilt = self.runtime.plan, self.runtime.plans[:self.runtime.prebuilt]
        bases = [p for p in prebuilt if not p.replicas] or prebuilt
        key = (current.domains, current.rails)
        here = next((i for i, b in enumerate(bases) if (b.domains, b.rails) == key), -1)
        hot = {}
        if self.config.replica_budget != 0 and self.routing is not None and not current.replicas:
            workload = self.workload.replace(routing_counts=np.rint(self.routing).astype(np.int64))
            model = CostModel(self.measured_topology(), workload)
            variants = with_hot_plans(model, bases, self.config.replica_budget)[len(bases):]
            hot = {(h.domains, h.rails): h for h in variants}
        nxt = hot.get(key) or bases[(here + 1) % len(bases)]
        return dataclasses.replace(r, switch=nxt != current, plan=nxt, reason=f"cycle every {self.config.cycle_every}")

    def decide(self, iteration: int) -> Decision:
        r = self._costed()
        switched = False
        cycling = self.config.cycle_every > 0
        if cycling:
            r = self._cycled(iteration, r)
        elif r.switch and r.current_seconds - r.best_seconds < self.config.min_gain * r.current_seconds:
            r = dataclasses.replace(r, switch=False, plan=self.runtime.plan, reason=(
                f"{r.plan.label} predicted only {1 - r.best_seconds / r.current_seconds:.1%} faster per step "
                f"(< min_gain {self.config.min_gain:.0%})"))
        if r.switch:
            # consecutive checks that want to leave the current plan; the latest best is the target (hot
            # variants of one base differ check to check as routing moves: keying on them never settles)
            self._streak += 1
            ready = all(len(v) >= self.config.window for v in self._samples.values())
            if cycling or (self._streak >= self.config.patience and ready):
                warn_once(log, "hybridep scheduler, iteration %d: switching %s -> %s (%s; predicted %.4g s -> %.4g s "
                    "per iteration; measured bandwidth %s Gbit/s per rank, compute %s s per iteration)",
                    iteration, self.runtime.plan.label, r.plan.label, r.reason, r.current_seconds, r.best_seconds,
                    {k: round(v, 3) for k, v in self.bandwidth_gbps.items()},
                    "n/a" if self.compute_s is None else f"{self.compute_s:.4g}")
                self.runtime.switch(self.runtime.adopt(r.plan))
                self._streak = 0
                self._iteration.clear()  # the old plan's step times: no network fit until the new plan's
                self.iteration_s = None
                switched = True
        else:
            self._streak = 0
        d = Decision(iteration, r, switched, dict(self.bandwidth_gbps), self.compute_s, self.network_factor)
        self.history.append(d)
        return d

    def step(self, iteration: int) -> Decision | None:
        """Call after every optimizer step (all ranks)."""
        now = time.perf_counter()
        iteration_s, self._tick = (now - self._tick if self._tick is not None else 0.0), now
        if iteration <= self.config.warmup or iteration % self.config.interval:
            return None
        if not self.config.overlap:
            self.update_estimates(self.measure(iteration_s))
            return self.decide(iteration)
        # The all-reduce of this interval runs during the next iteration; decide on the previous one's
        # (done by now): no wait for the slowest rank and no latency chain across the WAN per decision.
        previous, self._pending = self._pending, self._launch(iteration_s)
        if previous is None:
            return None
        self.update_estimates(self._finish(previous))
        return self.decide(iteration)

    def state_dict(self) -> dict[str, Any]:
        """What the next decisions read, for an exact resume: the estimates and their windows, the
        hysteresis streak, the network fit, the cost model's cached answer and the statistics
        all-reduce in flight (waited for here; the next decision reads its result). The active and
        adopted plans are the runtime's (HybridEPRuntime.state_dict)."""
        pending = None
        if self._pending is not None:
            work, t, g, e, levels = self._pending
            work.wait()
            self._pending = (_Done(), t, g, e, levels)
            pending = {"tensor": t.cpu(), "ep_size": g, "experts": e, "levels": list(levels)}
        cache = None
        if self._cache is not None:
            (active, bw, routing), r = self._cache
            fields = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}  # numpy floats: not weights_only
            cache = {"active": active, "bandwidth": {k: float(v) for k, v in bw.items()}, "routing": _tensor(routing),
                     "replan": {**{k: float(v) if isinstance(v, np.floating) else v for k, v in fields.items()},
                                "plan": r.plan.to_json(indent=None)}}
        return {"bandwidth_gbps": dict(self.bandwidth_gbps), "routing": _tensor(self.routing),
                "streak": self._streak, "samples": {k: list(v) for k, v in self._samples.items()},
                "compute_s": self.compute_s, "compute": list(self._compute), "iteration_s": self.iteration_s,
                "iteration": list(self._iteration), "network_factor": self.network_factor,
                "pending": pending, "cache": cache}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bandwidth_gbps = dict(state["bandwidth_gbps"])
        self.routing = _array(state["routing"])
        self._streak = state["streak"]
        self._samples = {k: list(v) for k, v in state["samples"].items()}
        self.compute_s, self._compute = state["compute_s"], list(state["compute"])
        self.iteration_s, self._iteration = state["iteration_s"], list(state["iteration"])
        self.network_factor = state["network_factor"]
        p = state["pending"]
        self._pending = None if p is None else (_Done(), p["tensor"], p["ep_size"], p["experts"], tuple(p["levels"]))
        c = state["cache"]
        self._cache = None if c is None else (
            (c["active"], dict(c["bandwidth"]), _array(c["routing"])),
            Replan(**{**c["replan"], "plan": Plan.from_json(c["replan"]["plan"])}))
        self._tick = time.perf_counter()  # the saved run's previous step: its wall time is not carried over

    def close(self) -> None:
        """Wait for the all-reduce in flight (call before the process group goes away)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None


class _Done:
    """A finished all-reduce (restored from a checkpoint)."""

    def wait(self) -> bool:
        return True


def _tensor(a: np.ndarray | None) -> torch.Tensor | None:
    return None if a is None else torch.from_numpy(np.array(a, dtype=np.float64))


def _array(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.cpu().numpy().copy()  # .cpu(): a checkpoint loaded onto the experts' GPU


def _faster(lv: Level, k: float) -> Level:
    """The level with its link and uplink rates multiplied by k."""
    return dataclasses.replace(lv, bandwidth_gbps=lv.bandwidth_gbps * k,
                               uplink_gbps=None if lv.uplink_gbps is None else lv.uplink_gbps * k)


def _scaled(topology: Topology, f: float) -> Topology:
    """Every level's rates divided by f."""
    if f == 1.0:
        return topology
    return dataclasses.replace(topology, levels=tuple(_faster(lv, 1 / f) for lv in topology.levels))


def _exposed_comm(topology: Topology, workload: Workload, plan: Plan) -> float:
    c = CostModel(topology, workload).evaluate(plan)
    return c.total - c.phases[Phase.PRE_COMPUTE] - c.phases[Phase.EXPERT_COMPUTE]


def per_rank_gbps(topology: Topology, i: int) -> float:
    """Configured rate of one rank's flow over level ``i`` while every rank of its unit sends at once
    (what a blocking collective of all ranks measures per rank): the sibling link or an equal share of
    the unit's uplink, whichever is smaller."""
    lv, inside = topology.levels[i], math.prod(topology.level_counts[i + 1:])
    return lv.bandwidth_gbps if lv.uplink_gbps is None else min(lv.bandwidth_gbps, lv.uplink_gbps / inside)


def calibrated(topology: Topology, workload: Workload, plan: Plan, compute_s: float) -> Workload:
    """The workload with its compute speed set so that the cost model's compute of ``plan`` (the
    running one: pre-expert and expert compute, forward and backward) equals the measured compute."""
    c = CostModel(topology, workload).evaluate(plan)
    predicted = c.phases[Phase.PRE_COMPUTE] + c.phases[Phase.EXPERT_COMPUTE]
    if predicted <= 0 or compute_s <= 0:
        return workload
    k = predicted / compute_s  # < 1: the ranks are slower than the workload says
    t_pre = None if workload.t_pre_ms is None else workload.t_pre_ms / k
    return workload.replace(throughput_tflops=workload.throughput_tflops * k, t_pre_ms=t_pre)


def _close(a: tuple, b: tuple, tol: float) -> bool:
    """Same plan, same measured levels, every bandwidth within tol, the routing matrix within tol (L1)."""
    (plan_a, bw_a, rt_a), (plan_b, bw_b, rt_b) = a, b
    if plan_a != plan_b or bw_a.keys() != bw_b.keys() or (rt_a is None) != (rt_b is None):
        return False
    if any(abs(bw_a[k] - bw_b[k]) > tol * abs(bw_a[k]) for k in bw_a):
        return False
    # routing as a whole (L1): per-expert counts of a few hundred tokens jitter by more than tol
    return rt_a is None or float(np.abs(rt_a - rt_b).sum()) <= tol * max(float(np.abs(rt_a).sum()), 1.0)
