"""The parent's side of `hybridep bench`'s control protocol (bench/control): what each rank-0 request
is answered with, WAN shaping between the unshaped and shaped phases, the planner's choice per
point, and the progress lines.

One launch of the rank workers serves one system run (a calibration and its measurement, or one of
auto's trials): then the worker is told "done" and bench.py forks a fresh set of ranks from the warm
host (Session.pending). Each layout builds its own process groups and gloo never frees an old
group's threads: a launch per point held 170 threads per rank by its trials, the machine's load
rose from 3 to 30, and those trials ran 1.3-1.9x their twin's calibration (docs/results.md, "A fresh
launch per system run")."""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np

from megatron_hybridep.bench import finalists as bf
from megatron_hybridep.bench import predict as bp
from megatron_hybridep.bench.config import (
    AUTO,
    COMPRESSED,
    LAYOUTS,
    PRICED_COMPRESSED,
    SYSTEMS,
    BenchConfig,
    BenchError,
)
from megatron_hybridep.bench.probes import probe_summary, steady_efficiency
from megatron_hybridep.plan.layout import Layout, is_hybridep, layout_workload
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.workload import GRAD_VALUE_BYTES
from megatron_hybridep.testbed.network import Testbed
from megatron_hybridep.testbed.selfcheck import TCP_GOODPUT_FRACTION, measure_throughput

PROBE_S = 0.4  # seconds per bandwidth probe (unshaped cross-DC and intra-DC)
PROBE_REPEATS = 9  # bare all-to-alls on the unshaped, then the shaped WAN (median)


class Progress:
    """Stream for the launcher: prints one line per finished point (rank 0's events), drops the rest
    (every rank's full output is in <out>/logs)."""

    def __init__(self, t0: float, sink: IO[str] | None) -> None:
        self.t0, self.sink = t0, sink

    def write(self, text: str) -> None:
        if self.sink is None or not text.startswith("[r0 ") or '"event": "point"' not in text:
            return
        e = json.loads(text.split("BENCH ", 1)[1])
        self.sink.write(f"[{time.monotonic() - self.t0:6.0f}s] {e['phase']:<9} {e['system']:<10} {e['plan']:<17} "
                        f"{e['tokens']:>6} tokens: median {e['median_s'] * 1e3:8.1f} ms\n")
        self.sink.flush()

    def flush(self) -> None:
        pass


@dataclass
class Session:
    """The parent's side of the control protocol. Point by point, system by system: build and
    calibrate with the WAN unshaped, then shape it and measure (HybridEP: the planner's plan)."""

    cfg: BenchConfig
    tb: Testbed
    log: IO[str]
    queue: list[tuple[int, str]] = field(default_factory=list)
    current: tuple[int, str] | None = None
    launch_served: bool = False  # the running launch has had its system run (the next "next" ends it)
    shaped: bool = True
    probes_left: list[bool] = field(default_factory=list)  # the all-to-all probes still to run: shaped or not
    candidates: list[Plan] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # rank 0's, from the control requests
    chosen: dict[tuple[int, str], Plan] = field(default_factory=dict)  # the plan per (point, system): HybridEP's,
    #   and a layout system's (plain EP over a stage's ranks for pp; the layout planner's for auto, auto-c)
    layouts: dict[tuple[int, str], Layout] = field(default_factory=dict)  # pp's and auto's layout per point
    finals: dict[tuple[int, str], list[bf.Finalist]] = field(default_factory=dict)  # auto's (bench/finalists.py)
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # highest traffic first: its comparison matters most, and on a shared machine the first
        # minutes are the ones most likely to see the load the run started with. Rounds after the first
        # interleave the systems in alternating orders (the first: EP's calibration feeds the planners).
        order = [s for s in SYSTEMS if s in self.cfg.systems]
        self.queue = [(p["index"], s) for p in reversed(self.cfg.points) for r in range(self.cfg.rounds)
                      for s in (order if r % 2 == 0 else order[::-1])]
        self.info.update(chosen={}, planner_best={}, shaped_tx_bytes=0.0)

    def pending(self) -> bool:
        """Whether another launch of the ranks is needed (for the next system run)."""
        self.launch_served = False
        return bool(self.queue) or not self.candidates

    def say(self, msg: str) -> None:
        if not self.cfg.quiet:
            self.log.write(msg + "\n")
            self.log.flush()

    def set_shaped(self, shaped: bool) -> None:
        if shaped == self.shaped:
            return
        now = self.tb.link_counters()
        if shaped:
            self.info["_counters"] = now
        elif (before := self.info.pop("_counters", None)) is not None:  # a shaped segment ended: its bytes (tx)
            self.info["shaped_tx_bytes"] += sum(b.tx_bytes - a.tx_bytes for a, b in zip(before, now, strict=True))
        for dc in range(self.tb.dcs):  # the testbed keeps its HTB burst setting (TestbedConfig.burst_ms)
            self.tb.set_rate(dc, self.cfg.rate_mbit if shaped else None)
        self.shaped = shaped

    def probe(self) -> None:
        """Unshaped cross-DC and intra-DC bandwidth (the unshaped Topology) and the candidate plans."""
        self.set_shaped(False)
        self.info["unshaped_wan_mbit"] = measure_throughput(self.tb, 0, 1, seconds=PROBE_S).mbit
        self.info["intra_mbit"] = measure_throughput(self.tb, 0, 0, seconds=PROBE_S).mbit
        self.candidates = bp.candidate_plans(self.topology(shaped=True), self.cfg.model.num_experts)
        self.say(f"WAN unshaped {self.info['unshaped_wan_mbit']:.0f} Mbit/s, intra-DC {self.info['intra_mbit']:.0f} "
                 f"Mbit/s (measured); shaped: {self.cfg.rate_text} per DC uplink; HybridEP candidates: "
                 + ", ".join(p.label for p in self.candidates))

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        self.events += request.get("events", [])
        if op == "next":
            if not self.candidates:
                self.probe()
                self.probes_left = [False, True]  # the bare all-to-alls unshaped, then shaped (bench/probes.py)
            if self.probes_left:
                shaped = self.probes_left.pop(0)
                self.set_shaped(shaped)
                m = self.cfg.model  # EP's all-to-all of each point, bytes per rank
                sizes = [p["tokens"] * m.top_k * m.hidden_size * bp.FP32 for p in self.cfg.points]
                return {"probe": {"sizes": sizes, "repeats": PROBE_REPEATS, "shaped": shaped}}
            self.set_shaped(False)
            while True:
                if not self.queue or self.launch_served:
                    return {"done": True}  # the sweep is over, or this launch's run is (fresh ranks per run)
                self.current = self.queue.pop(0)
                order = self._order(*self.current)
                if order is not None:
                    self.launch_served = True
                    return order
        if op == "shape":
            assert self.current is not None
            self.set_shaped(True)
            hybrid = self.current[1].startswith("hybridep") or (self.current[1] in AUTO
                                                                 and is_hybridep(self.chosen[self.current]))
            return {"measure": [0] if hybrid else [None]}
        raise BenchError(f"control: unknown request {request!r} from the rank 0 worker")

    def _order(self, point: int, system: str) -> dict[str, Any] | None:
        """What the ranks run for ``system`` at ``point``; None for an auto layout that is a system
        measured at this point already (it is that system's row: a second run would add only noise)."""
        order: dict[str, Any] = {"system": system, "point": self.cfg.points[point],
                                 "warmup": self.cfg.warmup, "iters": self.cfg.iters}
        if (point, system) in self.chosen:  # a later round: what the first one chose runs again
            return self._again(point, system, order)
        if system.startswith("hybridep"):  # EP ran first at this point: its calibration feeds the planner
            order["plans"] = [self.choose_plan(point, system).to_dict()]
        if system in AUTO and (trial := self._trial(point, system)) is not None:
            self.queue.insert(0, (point, system))  # back to it once the trial's unshaped step is in
            return {**order, **trial}
        if system in LAYOUTS:
            order.update(self.choose_layout(point, system))
            same = self.same_system(point, system) if system in AUTO else None
            if same is not None:
                self.info.setdefault("same_as", {})[f"{point} {system}"] = same
                self.say(f"point {point}: {system} chose {order['layout']['name']}, the {same} system's layout: "
                         "its measurement stands for both")
                return None
        return self._compressed(system, order)

    def _again(self, point: int, system: str, order: dict[str, Any]) -> dict[str, Any] | None:
        """A later round's order: the first round's plan and layout (None where auto's layout is a
        system measured at this point: that system's rounds stand for it)."""
        key = (point, system)
        if system in LAYOUTS:
            if f"{point} {system}" in self.info.get("same_as", {}):
                return None
            order.update(self._layout_order(self.layouts[key], self.chosen[key]))
        else:
            order["plans"] = [self.chosen[key].to_dict()]
        return self._compressed(system, order)

    def _compressed(self, system: str, order: dict[str, Any]) -> dict[str, Any]:
        if system in PRICED_COMPRESSED and order.get("plans"):  # auto-c runs compressed only in a hybridep plan
            order.update(compression_ratio=self.cfg.compression_ratio,
                         grad_compression_ratio=self.cfg.grad_compression_ratio, grad_values=self.cfg.grad_values,
                         early_grad_return=self.cfg.early_grad_return)
        return order

    def _trial(self, point: int, system: str) -> dict[str, Any] | None:
        """The next unshaped trial of an auto system's finalists at ``point`` (bench/finalists.py), or
        None when each has its unshaped step."""
        key = (point, system)
        if key not in self.finals:
            shaped = self.topology(shaped=True)
            cands = bf.finalists(bp.layout_results(shaped, self.workload(self.cfg.points[point], self.events, system)))
            for f in cands:
                f.same_as = self._same(point, system, f.layout, f.plan)
            kept, dropped = bf.trim(cands, self.cfg.auto_trials)
            self.finals[key] = kept
            self.info.setdefault("finalists", {})[f"{point} {system}"] = {"dropped": [f.name for f in dropped]}
        finals = self.finals[key]
        order = bf.trial_order(0 if len(finals) == 1 and finals[0].same_as else len(finals))
        for i, j in enumerate(order):  # the next trial due: its finalist's count so far in the order
            f = finals[j]
            if len(self._trials(point, system, f)) < order[:i + 1].count(j):
                self.say(f"point {point}: {system}: unshaped trial of {f.name} (planner: {f.planner_s * 1e3:,.0f} ms)")
                return self._compressed(system, {**self._layout_order(f.layout, f.plan), "trial": True,
                                                 "iters": max(self.cfg.iters, bf.TRIAL_ITERS)})
        base = bf.speed_base([e for f in finals for e in self._trials(point, system, f)]) if bf.SCALE_TRIALS else None
        for f in finals:
            if f.unshaped_s is None:
                if trials := self._trials(point, system, f):
                    f.unshaped_s, f.unshaped_ranks = bf.trial_step(trials, base)
                    f.speed_scale = bf.speed_scale(trials, base)
                    f.trialled, f.trials = True, len(trials)
                else:  # a lone finalist: its twin's calibration (nothing to compare it with)
                    e = self._calibration(point, f.same_as)
                    f.unshaped_s, f.unshaped_ranks = float(e["median_s"]), e.get("ranks")
        return None

    def _trials(self, point: int, system: str, f: bf.Finalist) -> list[dict[str, Any]]:
        """A finalist's unshaped trials at ``point``, in the order they ran (bench/finalists.trial_order: each
        twice, back to back with the other finalists': a twin system's calibration ran minutes earlier, and
        the ranks' step drifts over a point by more than the finalists differ)."""
        return [e for e in self.events if e["event"] == "point" and e["point"] == point and e["phase"] == "trial"
                and e["system"] == system and e["plan"] == f.name]

    def _calibration(self, point: int, system: str | None) -> dict[str, Any]:
        return next(e for e in reversed(self.events) if e["event"] == "point" and e["point"] == point
                    and e["phase"] == "calibrate" and e["system"] == system)

    def same_system(self, point: int, system: str = "auto") -> str | None:
        """The system run earlier at ``point`` (in this run's queue order) whose configuration is the
        ``system`` layout's (auto or auto-c): the same stages, EP size, micro-batches, dispatcher,
        (HybridEP) plan and compression."""
        return self._same(point, system, self.layouts[(point, system)], self.chosen[(point, system)])

    def _same(self, point: int, system: str, lay: Layout, plan: Plan) -> str | None:
        world, per_dc, m = self.cfg.world, self.cfg.ranks_per_dc, self.cfg.micro_batches
        if lay.tp != 1:
            return None
        if is_hybridep(plan):
            twin = COMPRESSED if system in PRICED_COMPRESSED else "hybridep"
            other = self.chosen.get((point, twin))
            same = (lay.pp == 1 and lay.ep == world and lay.micro_batches == m and other is not None
                    and _bare(other) == _bare(plan))
            return twin if same else None
        pp = bp.pp_layout(self.cfg.dcs, per_dc, m)
        for other, key in (("ep", (1, world, m)), ("replicated", (1, per_dc, m)),
                           ("pp", (pp.pp, pp.ep, pp.micro_batches))):  # all queued before auto
            if other in self.cfg.systems and (lay.pp, lay.ep, lay.micro_batches) == key:
                return other
        if system != "auto" and (point, "auto") in self.layouts:  # auto-c's plain choice, run as auto
            if (self.layouts[(point, "auto")], _bare(self.chosen[(point, "auto")])) == (lay, _bare(plan)):
                return "auto"
        return None

    def topology(self, shaped: bool) -> Any:
        wan = self.cfg.rate_mbit * TCP_GOODPUT_FRACTION if shaped else self.info["unshaped_wan_mbit"]
        return bp.testbed_topology(self.cfg.dcs, self.cfg.ranks_per_dc, wan, self.info["intra_mbit"])

    def workload(self, point: dict[str, int], events: list[dict[str, Any]], system: str = "ep") -> Any:
        """Workload of a point, fed with EP's unshaped compute timings (per step, all layers); the
        compressed system's codec ratio and shared-expert refresh bytes (reported by its ranks)."""
        e = next(e for e in events if e["event"] == "point" and e["phase"] == "calibrate" and e["system"] == "ep"
                 and e["point"] == point["index"])
        r = e["ranks"]
        calib = bp.Calibration(r["t_pre"], r["expert_fwd"], r["expert_rows"])
        dense = next((m["dense_params"] for m in events if m["event"] == "model" and m["system"] == "ep"), None)
        mode = {"micro_batches": self.cfg.micro_batches, "hold_copies": self.cfg.hold_copies,
                "overlap_grad_reduce": self.cfg.overlap_grad_reduce, "dense_params": dense}
        if system not in PRICED_COMPRESSED:
            return calib.workload(self.cfg.model, point["tokens"], point["seq"], **mode)
        sync = next((m.get("shared_sync_bytes_per_layer", 0.0) for m in events if m["event"] == "model"
                     and m["system"] == COMPRESSED), 0.0)
        return calib.workload(self.cfg.model, point["tokens"], point["seq"], self.cfg.compression_ratio, sync,
                              grad_compression_ratio=self.cfg.grad_compression_ratio,
                              grad_value_bytes=GRAD_VALUE_BYTES[self.cfg.grad_values],
                              early_return_rest_ratio=self.cfg.early_grad_return, **mode)

    def choose_plan(self, point: int, system: str = "hybridep") -> Plan:
        """The planner's HybridEP plan for this point and system, from EP's calibration of it."""
        work = self.workload(self.cfg.points[point], self.events, system)
        result = bp.plan_for_point(self.topology(shaped=True), work, self.cfg.world)
        plan = bp.best_domains_plan(result)
        self.chosen[(point, system)] = plan
        self.info["chosen"][f"{point} {system}"] = plan.label
        self.info["planner_best"][f"{point} {system}"] = result.best.label
        return plan

    def choose_layout(self, point: int, system: str) -> dict[str, Any]:
        """A layout system's order fields: its stages, EP size, micro-batches, dispatcher and plan.
        pp: one stage per DC, alltoall EP inside it; auto (auto-c): the layout planner's choice from EP's
        calibration of this point, exact (with HybridEP-c's ratios priced); HybridEP's dispatcher where
        its plan needs it."""
        shaped = self.topology(shaped=True)
        if system == "pp":
            layout = bp.pp_layout(self.cfg.dcs, self.cfg.ranks_per_dc, self.cfg.micro_batches)
            plan = bp.stage_plan(shaped, layout.pp, layout.ep, self.cfg.model.num_experts)
        else:
            layout, plan = self._choose_finalist(point, system)
        self.layouts[(point, system)], self.chosen[(point, system)] = layout, plan
        self.info.setdefault("layouts", {})[f"{point} {system}"] = {"layout": dataclasses.asdict(layout),
                                                                     "plan": plan.to_dict()}
        return self._layout_order(layout, plan)

    def _choose_finalist(self, point: int, system: str) -> tuple[Layout, Plan]:
        """Each finalist predicted from its unshaped step as the analysis predicts a row; the fastest."""
        probes = probe_summary(self.cfg, self.events)
        eff, steady = probes.get(point, {}).get("efficiency", 1.0), steady_efficiency(probes)
        dense = next(e["dense_params"] for e in self.events if e["event"] == "model")
        cands = self.finals[(point, system)]
        for f in cands:
            assert f.unshaped_s is not None  # _trial ran first
            f.predicted_s = self.prediction(point, system, f.plan, f.unshaped_s, dense, eff, steady, f.layout,
                                            f.unshaped_ranks).total
        best = bf.choose(cands)
        rec = self.info["finalists"][f"{point} {system}"]
        rec.update(chosen=best.name, finalists=[f.to_dict() for f in cands])
        self.say(f"point {point}: {system}: " + ", ".join(
            f"{f.name} {f.predicted_s * 1e3:,.0f} ms" for f in cands) + f" predicted: runs {best.name}")
        return best.layout, best.plan

    def prediction(self, point: int, system: str, plan: Plan, unshaped_s: float, dense: int, eff: float,
                   steady: float, layout: Layout | None = None,
                   unshaped_ranks: dict[str, float] | None = None) -> bp.Prediction:
        """A system's predicted step at ``point`` from its unshaped one (bench/predict.py); ``layout``:
        pp's and auto's (one stage's plan in the layout's workload); ``unshaped_ranks``: that run's
        per-rank figures (its expert gathers' lead, its ranks' CPU seconds)."""
        work = self.workload(self.cfg.points[point], self.events, system)
        if layout is not None:
            work = layout_workload(work, layout.tp, layout.pp)
        one_stage = layout is None or (layout.pp, layout.tp) == (1, 1)  # every MoE layer, each rank's tokens
        if one_stage and (routing := self.routing(point)) is not None and routing.shape[1] == plan.ep_size:
            work = work.replace(routing_counts=routing)  # the same plan priced alike as a system or a finalist
        cpu = (unshaped_ranks or {}).get("cpu_s")
        share = self.cpu_share(point)
        if cpu is not None and share is not None:  # against what a rank gets here when nothing idles it
            cpu *= self.cfg.cores / self.cfg.world / share
        return bp.predict(self.topology(shaped=True), self.topology(shaped=False), work, plan, dense, unshaped_s, eff,
                          steady, shared_cores=self.cfg.cores, gather_lead=bp.GatherLead.from_ranks(unshaped_ranks),
                          rank_cpu_s=cpu)

    def routing(self, point: int) -> np.ndarray | None:
        """Tokens each rank routed to each expert per micro-batch in EP's unshaped run at ``point``,
        (MoE layers, ranks, experts): the router's skew, which sets a token all-to-all's busiest link
        (every system builds the same router); None for runs recorded before the worker kept it."""
        e = next((e for e in self.events if e["event"] == "point" and e["phase"] == "calibrate"
                  and e["system"] == "ep" and e["point"] == point and e.get("routing")), None)
        if e is None:
            return None
        layers = sorted(e["routing"][0], key=int)
        return np.array([[rank[k] for rank in e["routing"]] for k in layers], dtype=np.float64)

    def cpu_share(self, point: int) -> float | None:
        """A rank's CPU seconds per wall second in the unshaped runs at ``point`` of the systems without a
        pipeline (ep, replicated, hybridep: their ranks have no bubble to idle in), the median; None
        before any. On 2 cores it is 6-17% below cores / ranks (the kernel's network work, the parent,
        gloo's threads counted in it), and pp's ranks read the same: measured against cores / ranks,
        that shortfall read as idle cores and priced pp's sends exposed (+375 ms where -50 was measured,
        4 DCs x 2 at 10 Mbit/s, 32 tokens)."""
        shares = [e["ranks"]["cpu_s"] / e["median_s"] for e in self.events
                  if e["event"] == "point" and e["point"] == point and e["phase"] == "calibrate"
                  and e["system"] not in LAYOUTS and "cpu_s" in e.get("ranks", {}) and e["median_s"] > 0]
        return statistics.median(shares) if shares else None

    @staticmethod
    def _layout_order(layout: Layout, plan: Plan) -> dict[str, Any]:
        """A layout's order fields: its stages, EP size, micro-batches, dispatcher and plan."""
        hybrid = is_hybridep(plan)
        return {"layout": {"pp": layout.pp, "ep": layout.ep, "name": bf.layout_name(layout, plan)},
                "micro_batches": layout.micro_batches, "dispatcher": "hybridep" if hybrid else "alltoall",
                **({"plans": [plan.to_dict()]} if hybrid else {})}


def _bare(plan: Plan) -> Plan:
    """The plan without the planner's figures: what the ranks run."""
    return dataclasses.replace(plan, predicted={}, link_bytes={})
