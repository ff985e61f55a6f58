"""`hybridep bench --rounds R`: every system measured R times per point, interleaved (later rounds in
alternating orders), each later round running what the first one chose, and the rows pooling the
rounds. No testbed here: the session is driven as the control loop drives it."""

from __future__ import annotations

import statistics

import pytest

from megatron_hybridep.bench.analysis import pool_rounds
from megatron_hybridep.bench.config import BenchError
from tests.testbed.test_bench_finalists import _cfg, _session

SYSTEMS = "ep,replicated,hybridep-compressed,pp,auto-c"


def test_rounds_interleave_the_systems_point_by_point_in_alternating_orders():
    s = _session(_cfg(systems=SYSTEMS, rounds=3))
    first = SYSTEMS.split(",")
    per_point = first + first[::-1] + first
    assert s.queue == [(1, x) for x in per_point] + [(0, x) for x in per_point]  # highest traffic first
    assert _session(_cfg(systems=SYSTEMS)).queue == [(1, x) for x in first] + [(0, x) for x in first]


def test_a_later_round_runs_the_first_rounds_plan_and_layout_without_planning_again(monkeypatch):
    s = _session(_cfg(systems=SYSTEMS, rounds=2))
    s.queue = [(0, "hybridep-compressed"), (0, "pp"), (0, "pp"), (0, "hybridep-compressed")]
    orders = [_next(s) for _ in range(2)]

    def no_planning(*a, **k):
        raise AssertionError("a later round planned again")

    monkeypatch.setattr(s, "choose_plan", no_planning)
    monkeypatch.setattr(s, "choose_layout", no_planning)
    again = [_next(s) for _ in range(2)]
    assert again[0] == orders[1] and again[1] == orders[0]  # the same orders, in the reversed sequence
    assert again[1]["compression_ratio"] == s.cfg.compression_ratio and again[1]["plans"]
    assert again[0]["layout"]["pp"] == s.cfg.dcs


def test_a_later_round_of_an_auto_layout_that_is_a_measured_system_is_skipped():
    s = _session(_cfg(systems=SYSTEMS, rounds=2))
    s.queue = [(0, "auto-c"), (0, "ep")]
    s.chosen[(0, "auto-c")] = object()  # type: ignore[assignment]  # the first round chose EP's layout
    s.info["same_as"] = {"0 auto-c": "ep"}
    order = _next(s)
    assert order["system"] == "ep" and not s.queue  # auto-c's round was skipped: EP's rounds stand for it


def _next(s):
    """The first order of a fresh launch of the ranks (bench/cli's loop)."""
    assert s.pending()
    return s.handle({"op": "next", "events": []})


def test_each_system_run_gets_a_fresh_launch_of_the_ranks():
    """A launch per point piled up each layout's gloo threads (170 per rank by auto's trials) and its
    later runs read 1.3-1.9x slow: a launch now serves one run and is then told "done"."""
    s = _session(_cfg(systems=SYSTEMS, rounds=1))
    s.queue = [(0, "ep"), (0, "replicated")]
    assert _next(s)["system"] == "ep"
    assert s.handle({"op": "next", "events": []}) == {"done": True}  # the same launch asks again
    assert _next(s)["system"] == "replicated" and not s.queue
    assert s.handle({"op": "next", "events": []}) == {"done": True} and not s.pending()


def _point(system, steps, tx, load, ranks, phase="measure"):
    return {"event": "point", "phase": phase, "system": system, "plan": system, "point": 0, "iters": len(steps),
            "step_s": steps, "median_s": statistics.median(steps), "warmup_s": 1.0, "loadavg": load,
            "link": [{"dc": 0, "tx_bytes": tx, "rx_bytes": 2 * tx, "tcp_timeouts": 1},
                     {"dc": 1, "tx_bytes": 10 * tx, "rx_bytes": tx, "tcp_timeouts": 0}],
            "ranks": {"grad_sync": ranks}}


def test_pool_rounds_pools_iterations_sums_link_counters_and_keeps_single_rounds():
    model = {"event": "model", "system": "ep"}
    a1 = _point("ep", [1.0, 5.0, 2.0], 100, (2.0, 4.0), 0.1)
    calib = _point("ep", [0.5], 1, (1.0, 1.0), 0.0, phase="calibrate")
    b = _point("replicated", [3.0], 7, (1.0, 1.0), 0.3)
    a2 = _point("ep", [4.0, 4.5, 9.0], 50, (6.0, 8.0), 0.5)
    pooled = pool_rounds([model, a1, calib, b, a2])
    assert [e.get("system") for e in pooled] == ["ep", "ep", "ep", "replicated"]  # first-seen order
    ep = pooled[1]
    assert ep["rounds"] == 2 and ep["iters"] == 6 and ep["step_s"] == [1.0, 5.0, 2.0, 4.0, 4.5, 9.0]
    assert ep["median_s"] == pytest.approx(4.25)  # over all six iterations, not a median of medians
    assert ep["link"] == [{"dc": 0, "tx_bytes": 150, "rx_bytes": 300, "tcp_timeouts": 2},
                          {"dc": 1, "tx_bytes": 1500, "rx_bytes": 150, "tcp_timeouts": 0}]
    assert ep["loadavg"] == [4.0, 6.0] and ep["ranks"]["grad_sync"] == pytest.approx(0.3)
    assert pooled[2] is calib and pooled[3] is b  # one round: left as it is


def test_rounds_must_be_positive_and_reach_the_command():
    with pytest.raises(BenchError, match="--rounds: must be >= 1, got 0; fix"):
        _cfg(rounds=0)
    assert "--rounds 2" in _cfg(rounds=2).command() and "--rounds" not in _cfg().command()
