"""The bench's auto systems (bench/finalists.py): the planner's finalists, each predicted from its
measured unshaped step (a measured system's calibration, or an unshaped trial), the fastest run.
At 4 DCs x 2 and 32 tokens the planner alone chose PP2 EP4 (its model: 759 ms against HybridEP-c's
1.15 s); measured unshaped, that layout's step was 3.52 s against HybridEP-c's 2.90 s, and it ran
16% slower than HybridEP-c. No testbed here: the session is driven with recorded-style events."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from megatron_hybridep.bench import finalists as bf
from megatron_hybridep.bench import predict as bp
from megatron_hybridep.plan.layout import Layout, is_hybridep, plan_layouts
from megatron_hybridep.plan.plan import Plan

CALIB = bp.Calibration(t_pre_s=0.05, expert_fwd_s=0.02, expert_rows=4096.0)


def _cfg(**kw):
    import argparse

    from megatron_hybridep.bench.cli import add_arguments, resolve

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = {"dcs": 4, "ranks_per_dc": 2, "rate": "10mbit", "points": 2, "min_tokens": 32, "seq": 32,
            "micro_batches": 8, "model": "configs/models/bench-moe-deep.yaml",
            "systems": "ep,replicated,hybridep-compressed,pp,auto,auto-c", **kw}
    return resolve(parser.parse_args([x for k, v in base.items() for x in (f"--{k.replace('_', '-')}", str(v))]))


def _results(cfg, tokens=32):
    topo = bp.testbed_topology(cfg.dcs, cfg.ranks_per_dc, 9.6, 1000.0)
    work = CALIB.workload(cfg.model, tokens, 32, micro_batches=cfg.micro_batches, overlap_grad_reduce=True,
                          dense_params=35_000)
    return plan_layouts(topo, work)


def test_finalists_are_the_layouts_priced_within_the_window_fastest_first():
    results = [r for r in _results(_cfg()) if r.fits and r.layout.tp == 1]
    cands = bf.finalists(results, within=1.0)
    best = min(r.step for r in results)
    assert cands and cands[0].planner_s == pytest.approx(best)
    assert all(f.planner_s <= 2 * best + 1e-12 for f in cands)
    assert [f.planner_s for f in cands] == sorted(f.planner_s for f in cands)
    assert len({(f.layout, f.plan) for f in cands}) == len(cands)
    assert all(not f.plan.predicted and not f.plan.link_bytes for f in cands)  # what the ranks run
    # nothing priced beyond the window made it, and a wider window admits more
    outside = [r for r in results if r.step > 2 * best]
    assert all(r.layout != f.layout or r.best.plan.label != f.plan.label for r in outside for f in cands)
    assert len(bf.finalists(results, within=10.0)) > len(cands)


def test_trim_keeps_every_measured_finalist_and_the_planners_fastest_trials():
    lay = Layout(1, 1, 8, 8, 8)
    fs = [bf.Finalist(lay, Plan.grid((8,), (1,), 16, ("gpu",)), s, same) for s, same in
          ((1.0, None), (1.1, "pp"), (1.2, None), (1.3, None), (1.4, "ep"))]
    kept, dropped = bf.trim(fs, max_trials=2)
    assert [f.planner_s for f in kept] == [1.0, 1.1, 1.2, 1.4]
    assert [f.planner_s for f in dropped] == [1.3]
    kept, dropped = bf.trim(fs, max_trials=0)
    assert [f.same_as for f in kept] == ["pp", "ep"] and len(dropped) == 3


def test_choose_takes_the_fastest_prediction_and_a_near_tie_goes_to_megatron():
    lay = Layout(1, 1, 8, 8, 8)
    plain = Plan.grid((4, 2), (1, 1), 16, ("dc", "gpu"))
    hybrid = Plan.grid((4, 2), (4, 1), 16, ("dc", "gpu"))
    assert is_hybridep(hybrid) and not is_hybridep(plain)

    def pick(t_plain, t_hybrid):
        return bf.choose([bf.Finalist(lay, plain, 0.5, predicted_s=t_plain),
                          bf.Finalist(lay, hybrid, 0.4, predicted_s=t_hybrid)]).plan

    assert pick(4.0, 3.0) == hybrid  # the planner's order does not decide: the predictions do
    assert pick(3.1, 3.0) == plain  # within 5%: no hybridep
    assert pick(2.0, 3.0) == plain
    # a compressed plan keeps a near-tie (docs/results.md, "The near-tie rule, measured")
    lossy = [bf.Finalist(lay, plain, 0.5, predicted_s=3.1),
             bf.Finalist(lay, hybrid, 0.4, predicted_s=3.0, compressed=True)]
    assert bf.choose(lossy).plan == hybrid
    lossy[0].predicted_s = 3.0  # an exact tie still goes to Megatron
    assert bf.choose(lossy).plan == plain
    with pytest.raises(ValueError, match="predicted"):
        bf.choose([bf.Finalist(lay, plain, 0.5)])


def _session(cfg):
    from megatron_hybridep.bench.session import Session

    s = Session(cfg, tb=None, log=io.StringIO())  # type: ignore[arg-type]  # nothing is shaped
    s.info.update(intra_mbit=1000.0, unshaped_wan_mbit=1000.0)
    s.shaped = False  # the WAN stays as it is: no testbed to shape
    s.candidates = bp.candidate_plans(s.topology(shaped=True), cfg.model.num_experts)
    s.events = [{"event": "model", "system": "ep", "dense_params": 35_000}]
    for p in cfg.points:
        s.events.append({"event": "point", "phase": "calibrate", "system": "ep", "plan": "ep", "point": p["index"],
                         "median_s": 3.0, "ranks": {"t_pre": CALIB.t_pre_s, "expert_fwd": CALIB.expert_fwd_s,
                                                    "expert_rows": CALIB.expert_rows}})
    return s


def test_session_trials_the_unmeasured_finalists_then_runs_the_fastest_prediction():
    cfg = _cfg(auto_trials=2, systems="ep,replicated,auto-c")
    s = _session(cfg)
    s.queue = [(0, "auto-c")]
    seen: list[str] = []

    def unshaped(name):  # the second finalist trialled is the fast one
        seen.append(name) if name not in seen else None
        return 2.0 if seen.index(name) == 1 else 5.0

    orders, order = _drive(s, "auto-c", unshaped)
    finals = s.finals[(0, "auto-c")]
    assert 2 == sum(f.same_as is None for f in finals)  # --auto-trials 2, nothing measured ran
    assert len(orders) == 4 and [o["layout"]["name"] for o in orders] == seen + seen[::-1]  # A B B A
    assert all(o["system"] == "auto-c" and "dispatcher" in o for o in orders)
    for o in orders:  # auto-c's trials of a hybridep plan run compressed, as its final run would
        assert ("compression_ratio" in o) == (o["dispatcher"] == "hybridep")
    chosen = next(f for f in finals if f.name == seen[1])
    assert order["layout"]["name"] == chosen.name and not order.get("trial")  # the final run: shaped after
    assert all(f.predicted_s > f.unshaped_s for f in finals)  # the shaped WAN adds network time
    assert chosen.predicted_s == min(f.predicted_s for f in finals)
    rec = s.info["finalists"]["0 auto-c"]
    assert rec["chosen"] == chosen.name and len(rec["finalists"]) == len(finals)


def test_trials_run_twice_in_mirrored_order_so_a_drift_cancels():
    """The ranks' unshaped step drifts over a point: here +10% per trial. B is 5% faster than A; trialled
    A then B once, the drift makes A look faster (4.0 against 4.18); A B B A reads A 4.6, B 4.37."""
    assert bf.trial_order(3) == [0, 1, 2, 2, 1, 0] and bf.trial_order(1) == [0] and bf.trial_order(0) == []
    cfg = _cfg(auto_trials=2, systems="ep,replicated,auto-c")
    s = _session(cfg)
    s.queue = [(0, "auto-c")]
    first: list[str] = []

    def drifting(name):
        first.append(name) if name not in first else None
        k = sum(e["phase"] == "trial" for e in s.events if e["event"] == "point")  # trials so far
        return (4.0 if first.index(name) == 0 else 3.8) * (1 + 0.1 * k)

    orders, _ = _drive(s, "auto-c", drifting)
    a, b = (next(f for f in s.finals[(0, "auto-c")] if f.name == n) for n in first)
    assert a.trialled and b.trialled
    assert a.unshaped_s == pytest.approx((4.0 + 4.0 * 1.3) / 2) and b.unshaped_s == pytest.approx(3.8 * 1.15)
    assert s.info["finalists"]["0 auto-c"]["chosen"] == b.name


def test_trial_step_is_the_median_of_every_step_and_the_mean_of_the_figures_every_trial_has():
    step, ranks = bf.trial_step([{"median_s": 2.0, "step_s": [2.0, 1.9, 2.1], "ranks": {"cpu_s": 1.0, "t_pre": 0.2}},
                                 {"median_s": 3.0, "step_s": [3.0, 3.2, 1.8], "ranks": {"cpu_s": 2.0}}])
    assert step == pytest.approx(2.05) and ranks == {"cpu_s": 1.5}  # a mean of the medians reads 2.5
    assert bf.trial_step([{"median_s": 2.0}]) == (2.0, None)  # events without their steps: the median


def test_trial_steps_are_scaled_to_the_hosts_speed_beside_them():
    a = {"median_s": 2.4, "step_s": [2.4, 2.5, 2.3], "speed_ref_s": 0.12}
    b = {"median_s": 2.0, "step_s": [2.0, 2.1, 1.9], "speed_ref_s": 0.08}
    assert bf.speed_base([a, b]) == pytest.approx(0.10)
    assert bf.trial_step([a], 0.10)[0] == pytest.approx(2.0)  # ran while the host was 1.2x slow
    assert bf.trial_step([b], 0.10)[0] == pytest.approx(2.5)
    assert bf.speed_scale([a, b], 0.10) == pytest.approx((1 / 1.2 + 1.25) / 2)
    assert bf.trial_step([a, b])[0] == pytest.approx(2.2) and bf.speed_scale([a], None) is None
    assert bf.speed_base([a, {"median_s": 2.0}]) is None  # a trial without the reference: none is scaled


def test_a_finalist_trialled_while_the_host_ran_slow_is_not_ranked_by_that(monkeypatch):
    """A's layout is 10% faster than B's, but both of A's trials ran while the host was 1.25x slow (the
    matmul beside them took 1.25x as long): unscaled, A reads 4.5 s against B's 4.0 s."""
    monkeypatch.setattr(bf, "SCALE_TRIALS", True)
    cfg = _cfg(auto_trials=2, systems="ep,replicated,auto-c")
    s = _session(cfg)
    s.queue = [(0, "auto-c")]
    seen: list[str] = []

    def slow_host(name):
        seen.append(name) if name not in seen else None
        if seen.index(name) == 0:
            return {"median_s": 3.6 * 1.25, "speed_ref_s": 0.05 * 1.25}
        return {"median_s": 4.0, "speed_ref_s": 0.05}

    _drive(s, "auto-c", slow_host)
    a, b = (next(f for f in s.finals[(0, "auto-c")] if f.name == n) for n in seen)
    base = 0.05 * 1.125  # the median reference of the four trials
    assert a.unshaped_s == pytest.approx(3.6 * 1.125) and b.unshaped_s == pytest.approx(4.0 * 1.125)
    assert a.speed_scale == pytest.approx(base / 0.0625) and b.to_dict()["speed_scale"] == pytest.approx(1.125)
    assert s.info["finalists"]["0 auto-c"]["chosen"] == a.name


RECORDED = (Path(__file__).resolve().parents[2] / "docs" / "results" / "layout_bench"
            / "2dc_x_2_deep_50mbit_m8_w10g4b16_reno_rounds2_routing")


def test_one_slow_trial_no_longer_decides_the_recorded_choice(monkeypatch):
    """2 DCs x 2 at 50 Mbit/s, 1024 tokens: HybridEP-c's first trial ran 1.86 / 2.48 / 2.35 s a step, its
    second 2.00 / 1.94 / 1.89 s. The mean of the two medians put PP4 EP1 first, and auto-c ran it 26%
    behind HybridEP-c's measured row. The same recorded trials, re-decided: HybridEP-c."""
    from megatron_hybridep.bench.reanalyse import restored_session

    def decide():
        summary, s = restored_session(RECORDED)
        first = next(i for i, e in enumerate(s.events) if e["event"] == "point" and e["point"] == 2
                     and e["phase"] == "calibrate" and e["system"] == "auto-c")
        s.events = s.events[:first]  # what the session had seen when it chose
        assert s._trial(2, "auto-c") is None  # every trial is there
        names = [f.name for f in s.finals[(2, "auto-c")]]
        assert sorted(names) == sorted(f["name"] for f in summary["finalists"]["2 auto-c"]["finalists"])
        layout, plan = s._choose_finalist(2, "auto-c")
        return bf.layout_name(layout, plan)

    assert decide() == "PP1 EP4 domains dc2 gpu1"
    pooled = bf.trial_step
    monkeypatch.setattr(bf, "trial_step", lambda trials, base=None: (sum(e["median_s"] for e in trials) / len(trials),
                                                          pooled(trials)[1]))
    assert decide() == "PP4 EP1"  # the mean of the medians, as the run chose


def test_a_tie_the_trials_cannot_break_goes_to_the_layout_the_planner_prices_clearly_faster():
    plain = Plan.grid((4, 2), (1, 1), 16, ("dc", "gpu"))
    pp4, ep8 = Layout(1, 4, 2, 1, 32), Layout(1, 1, 8, 1, 8)

    def pick(pred_pp, pred_ep, planner_pp, planner_ep):
        return bf.choose([bf.Finalist(pp4, plain, planner_pp, predicted_s=pred_pp),
                          bf.Finalist(ep8, plain, planner_ep, predicted_s=pred_ep)]).layout

    assert pick(3.05, 3.0, 0.4, 0.8) == pp4  # 1.7% apart on the trials: the planner's 2x decides
    assert pick(3.2, 3.0, 0.4, 0.8) == ep8  # 6.7% apart: the trials decide
    assert pick(3.05, 3.0, 0.40, 0.41) == ep8  # the planner's 2.4% is no clearer: the trials' order stands
    assert bf.TRIAL_TIE == 0.03


def _drive(s, system, unshaped):
    """The control loop over ``system``'s trials at point 0, each trial's unshaped step ``unshaped(name)``
    arriving with the next request: (the trial orders, the order that followed them)."""
    orders = []
    while True:
        s.launch_served = False
        order = s.handle({"op": "next", "events": []})
        if order.get("done") or not order.get("trial"):
            return orders, order
        orders.append(order)
        name = order["layout"]["name"]
        got = unshaped(name)  # a step, or the event's fields
        s.events.append({"event": "point", "phase": "trial", "system": system, "plan": name, "point": 0,
                         **(got if isinstance(got, dict) else {"median_s": got})})


def _with_pp(cfg, calibrated_s):
    s = _session(cfg)
    pp = bp.pp_layout(cfg.dcs, cfg.ranks_per_dc, cfg.micro_batches)
    s.layouts[(0, "pp")] = pp
    s.chosen[(0, "pp")] = bp.stage_plan(s.topology(shaped=True), pp.pp, pp.ep, cfg.model.num_experts)
    s.events.append({"event": "point", "phase": "calibrate", "system": "pp", "plan": "PP4 EP2", "point": 0,
                     "median_s": calibrated_s})
    s.queue = [(0, "auto")]
    return s


def test_measured_finalists_are_trialled_back_to_back_and_their_row_stands_for_auto():
    """A finalist a measured system stands for runs its own unshaped trial next to the others': pp's
    calibration (minutes earlier, 9 s) is not what decides."""
    cfg = _cfg(auto_trials=2, iters=2)
    s = _with_pp(cfg, calibrated_s=9.0)
    orders, order = _drive(s, "auto", lambda name: 1.5 if name == "PP4 EP2" else 4.0)
    finals = s.finals[(0, "auto")]
    assert len(finals) >= 2 and "pp" in {f.same_as for f in finals}
    assert all(o["iters"] == bf.TRIAL_ITERS == 3 for o in orders)  # a median that drops one slow step
    names = [f.name for f in finals]  # each trialled twice, the planner's order then back
    assert [o["layout"]["name"] for o in orders] == names + names[::-1]
    assert all(f.trialled for f in finals)
    rec = s.info["finalists"]["0 auto"]
    assert rec["chosen"] == "PP4 EP2" and all(f["trialled"] for f in rec["finalists"])
    assert order.get("done")  # auto chose a measured system's layout: its row stands for auto's
    assert s.info["same_as"]["0 auto"] == "pp"
    # the same calibrations with pp's trial slow: the trial decides, not the 9 s calibration or the old 1.5 s
    s = _with_pp(cfg, calibrated_s=1.5)
    _drive(s, "auto", lambda name: 9.0 if name == "PP4 EP2" else 4.0)
    assert s.info["finalists"]["0 auto"]["chosen"] != "PP4 EP2"


def test_a_lone_measured_finalist_takes_its_twins_calibration_without_a_trial():
    """--auto-trials 0 here leaves pp's layout alone: nothing to compare, so no trial."""
    s = _with_pp(_cfg(auto_trials=0), calibrated_s=1.5)
    orders, order = _drive(s, "auto", lambda name: pytest.fail("no trial expected"))
    assert orders == [] and order.get("done") and s.info["same_as"]["0 auto"] == "pp"
    (f,) = s.finals[(0, "auto")]
    assert f.same_as == "pp" and f.unshaped_s == 1.5 and not f.trialled
