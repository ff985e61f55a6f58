"""The bench's auto layouts on the testbed: the layout planner's finalists, re-ranked by measured steps.

The cost model prices compute from T_pre and the expert speed as if every rank had a device of its
own. On the testbed eight ranks share two cores and gloo's collectives cost CPU: a layout's unshaped
step is 3-10x the model's, and that gap differs between layouts by more than the network time the
planner weighs at small token counts (docs/results.md, "auto's finalists"). So the bench's auto takes
every layout the planner prices within FINALIST_WITHIN of its best (of those no system measured at the
point stands for, at most ``max_trials``, the planner's fastest first), runs a short unshaped trial of
each back to back, predicts each as every bench row is predicted (unshaped step + the shaped-minus-
unshaped network), and runs the fastest. Back to back, not a measured twin's calibration: the ranks'
unshaped step drifts over a point (a system's second-round calibration reads 1.10-1.39x its first:
the per-run medians of the recorded 4 DC x 2 runs), by more than the finalists differ. Twice, in
the order A B .. B A (trial_order), each predicted from the median of all its trials' steps
(trial_step): a drift linear over the trials cancels, and one slow trial (the first after a shaped
run read 12-21% high) moves it little. A lone finalist with a twin takes the twin's calibration:
there is nothing to compare. Finalists predicted within
TRIAL_TIE of the fastest are a tie the trials cannot break, and the planner's ranking breaks it
where it prices one clearly faster. A tie goes to the layout without hybridep as the planner's own
choice does (within PREFER_MEGATRON_WITHIN of an exact plan; a compressed one keeps the choice when
predicted faster).
`pretrain_moe.py --hybridep-layout auto` on GPUs takes the planner's choice as it is. Pure logic."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from megatron_hybridep.plan.layout import PREFER_MEGATRON_WITHIN, Layout, LayoutResult, is_hybridep, within_margin
from megatron_hybridep.plan.plan import Plan

FINALIST_WITHIN = 1.0  # layouts the planner prices at most 2x its best: the testbed's CPU costs move that much
MAX_TRIALS = 2  # finalists per auto system and point that no measured system stands for
TRIAL_ITERS = 3  # timed iterations of a trial at least: a median of 2 is their mean, and one slow step moved
#   HybridEP-c's trial 9% (4 DCs x 2, 50 Mbit/s, 1024 tokens: 3.98 and 4.69 s) and auto-c off the fastest
SPEED_KEY = "speed_ref_s"  # the host's speed beside each trial (bench/worker.speed_ref): HybridEP-c's trials
#   read 1.09-1.28x PP4 EP1's against their own calibrations while the whole rank ran slow (2 DCs x 2, 50 Mbit/s)
SCALE_TRIALS = False  # scale the trials to the host's speed (off: under evaluation, docs/results.md)
TRIAL_TIE = 0.03  # a measured trial's noise: the same configuration's trials and calibrations at a point read
#   3-12% apart (4 DCs x 2, 50 Mbit/s, 1024 tokens: HybridEP-c's trial 5.60 s, its calibrations 5.04 and 4.85)


def layout_name(layout: Layout, plan: Plan) -> str:
    """The label a layout system runs under (its rows and events), e.g. "PP2 EP4 domains dc2 gpu1"."""
    return f"PP{layout.pp} EP{layout.ep}" + (f" {plan.label}" if is_hybridep(plan) else "")


@dataclass
class Finalist:
    layout: Layout
    plan: Plan  # without the planner's figures: what the ranks run
    planner_s: float  # the planner's predicted step
    same_as: str | None = None  # the system measured at the point with this configuration
    unshaped_s: float | None = None  # its measured unshaped step (the system's calibration, or a trial)
    predicted_s: float | None = None  # unshaped_s + the network the cost model adds when the WAN is shaped
    unshaped_ranks: dict[str, float] | None = None  # that run's per-rank figures (bench/worker.py; trials: their mean)
    compressed: bool = False  # the plan runs the codec (the planner's candidate)
    trialled: bool = False  # unshaped_s is its own trials' (else its twin system's calibration)
    trials: int = 0  # how many (trial_order)
    speed_scale: float | None = None  # what trial_step scaled its trials' steps by (their median)

    @property
    def name(self) -> str:
        return layout_name(self.layout, self.plan)

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "planner_s": self.planner_s, "same_as": self.same_as,
                "unshaped_s": self.unshaped_s, "predicted_s": self.predicted_s, "trialled": self.trialled,
                "trials": self.trials, "speed_scale": self.speed_scale}


def finalists(results: list[LayoutResult], within: float = FINALIST_WITHIN) -> list[Finalist]:
    """Each layout's best plan, and its best plan without hybridep beside a hybridep best, priced
    within ``within`` of the fastest; fastest first. ``results``: plan_layouts' fitting layouts."""
    out: list[Finalist] = []
    fit = [r for r in results if r.fits]
    if not fit:
        return out
    limit = min(r.step for r in fit) * (1 + within)
    for r in fit:
        for cand, step in ((r.best, r.step), (r.megatron, r.megatron_step)):
            plan = replace(cand.plan, predicted={}, link_bytes={}) if cand is not None else None
            if plan is not None and step <= limit and all((f.layout, f.plan) != (r.layout, plan) for f in out):
                out.append(Finalist(r.layout, plan, step, compressed=cand.compressed))
    return sorted(out, key=lambda f: f.planner_s)


def trim(cands: list[Finalist], max_trials: int = MAX_TRIALS) -> tuple[list[Finalist], list[Finalist]]:
    """(kept, dropped): every finalist a measured system stands for, and the planner's fastest
    ``max_trials`` of the others."""
    kept, dropped, trials = [], [], 0
    for f in cands:
        if f.same_as is None:
            trials += 1
            if trials > max_trials:
                dropped.append(f)
                continue
        kept.append(f)
    return kept, dropped


def trial_order(n: int) -> list[int]:
    """The finalists' trials by index: 0 1 .. n-1 n-1 .. 1 0 (each twice, the second round reversed);
    a lone finalist once."""
    return list(range(n)) + list(reversed(range(n))) if n > 1 else list(range(n))


def speed_base(trials: list[dict]) -> float | None:
    """The host-speed reference a point's trials (every finalist's) are scaled to: the median of their
    SPEED_KEY, or None where one lacks it (runs before 2026-12-02 21:00)."""
    refs = [e.get(SPEED_KEY) for e in trials]
    return statistics.median(refs) if refs and all(r is not None and r > 0 for r in refs) else None


def speed_scale(trials: list[dict], base: float | None) -> float | None:
    """The median factor trial_step scales ``trials``' steps by (None: unscaled)."""
    return statistics.median(base / e[SPEED_KEY] for e in trials) if base is not None else None


def trial_step(trials: list[dict], base: float | None = None) -> tuple[float, dict[str, float] | None]:
    """(unshaped step, per-rank figures) of a finalist's trials (bench/worker.py "point" events): the median
    of every timed step of them all (a trial's median where it has no steps), each trial's steps scaled by
    ``base`` / its own SPEED_KEY when ``base`` is given (speed_base: the host's speed, the same for every
    finalist), and the mean of each per-rank figure every trial has. One slow trial moves a pooled median
    little: a mean of the two trials' medians took HybridEP-c's 2.35 s trial at half weight and cost auto-c
    26% (docs/results.md, "One slow trial, and waiting ranks keep part of the cores")."""
    def scale(e: dict) -> float:
        return base / e[SPEED_KEY] if base is not None else 1.0

    step = statistics.median(float(x) * scale(e) for e in trials for x in (e.get("step_s") or [e["median_s"]]))
    ranks = [e.get("ranks") or {} for e in trials]
    keys = set.intersection(*(set(r) for r in ranks))
    return step, ({k: sum(r[k] for r in ranks) / len(ranks) for k in sorted(keys)} if keys else None)


def choose(cands: list[Finalist], margin: float = PREFER_MEGATRON_WITHIN, tie: float = TRIAL_TIE) -> Finalist:
    """The finalist predicted fastest, unless another predicted within ``tie`` of it is priced by the
    planner more than ``tie`` faster (the trials cannot tell them apart: the planner's ranking does); the
    fastest without hybridep instead when it is within ``margin`` of an exact one (layout.within_margin)."""
    if not cands or any(f.predicted_s is None for f in cands):
        raise ValueError("choose: every finalist needs its predicted step")
    ranked = sorted(cands, key=lambda f: (f.predicted_s, f.planner_s))
    best = ranked[0]
    priced = min((f for f in ranked if f.predicted_s <= best.predicted_s * (1 + tie)), key=lambda f: f.planner_s)
    if priced.planner_s < best.planner_s * (1 - tie):
        best = priced
    plain = next((f for f in ranked if not is_hybridep(f.plan)), None)
    if is_hybridep(best.plan) and plain is not None \
            and within_margin(best.predicted_s, plain.predicted_s, best.compressed, margin):
        return plain
    return best
