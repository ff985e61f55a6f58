"""The bench's bare all-to-all probe (bench/probes.py): long probes' pooled share of the rate; short ones'
wire time over what shaping added, when the run probed unshaped too (recorded runs did not)."""

from types import SimpleNamespace

import pytest

from megatron_hybridep.bench import predict as bp
from megatron_hybridep.bench.probes import MIN_ADDED, STEADY_S, format_probe, probe_summary

RATE = 50.0  # Mbit/s
CFG = SimpleNamespace(rate_mbit=RATE, points=[{"tokens": 32}, {"tokens": 192}, {"tokens": 1024}])


def _event(point: int, wire_s: float, median_s: float, shaped: bool | None = True) -> dict:
    tx = wire_s * RATE * 1e6 / 8 * 5  # 5 repeats' bytes through one DC uplink
    e = {"event": "probe", "point": point, "bytes_per_rank": 1000 * (point + 1), "repeats": 5, "median_s": median_s,
         "link": [{"dc": 0, "tx_bytes": tx}, {"dc": 1, "tx_bytes": tx}]}
    if shaped is not None:  # recorded runs' events have no "shaped": they were all shaped
        e["shaped"] = shaped
    return e


SHAPED = [_event(0, 0.003, 0.005, None), _event(1, 0.012, 0.015, None), _event(2, 0.068, 0.074, None),
          {"event": "point"}]


def test_recorded_runs_keep_each_short_probes_share_of_the_rate():
    probes = probe_summary(CFG, SHAPED)
    assert probes[0]["ideal_s"] == pytest.approx(0.003) and probes[2]["ideal_s"] >= STEADY_S
    assert probes[0]["efficiency"] == pytest.approx(0.003 / 0.005)
    assert probes[1]["efficiency"] == pytest.approx(0.012 / 0.015)
    assert probes[2]["efficiency"] == pytest.approx(0.068 / 0.074)
    assert all("unshaped_s" not in v for v in probes.values())
    assert "each shorter probe's own share" in format_probe(CFG, probes)


def test_short_probes_count_only_what_shaping_added():
    # unshaped: the call's fixed cost (5 ms at 32 tokens, more than its 3 ms of wire)
    events = SHAPED[:3] + [_event(0, 0.003, 0.0055, False), _event(1, 0.012, 0.005, False),
                           _event(2, 0.068, 0.005, False)]
    probes = probe_summary(CFG, events)
    assert probes[1]["added_s"] == pytest.approx(0.010)
    assert probes[1]["efficiency"] == pytest.approx(0.012 / 0.010)
    # shaping added nothing the median can see: the floor, not a negative or infinite efficiency
    assert probes[0]["added_s"] < 0
    assert probes[0]["efficiency"] == pytest.approx(1 / MIN_ADDED)
    # a long probe's share of the rate is steady-state TCP: unchanged (the fixed cost hides in it)
    assert probes[2]["efficiency"] == pytest.approx(0.068 / 0.074)
    assert probes[2]["unshaped_s"] == pytest.approx(0.005)
    text = format_probe(CFG, probes)
    assert "unshaped 5.5 ms: -0.5 ms" in text and "what shaping added" in text


def test_a_short_calls_fixed_cost_is_not_charged_twice():
    """The prediction's token all-to-alls with the new efficiency: what shaping added to the probe,
    scaled to the point's bytes, instead of the whole shaped call."""
    shaped = bp.testbed_topology(2, 2, 47.8, 20_000.0)
    unshaped = bp.testbed_topology(2, 2, 3_000.0, 20_000.0)
    work = bp.Calibration(t_pre_s=0.05, expert_fwd_s=0.02, expert_rows=16384).workload(bp.BUILTIN, 32, 32)
    plan = bp.system_plan("ep", shaped, 8)
    events = SHAPED[:1] + [_event(0, 0.003, 0.004, False)]
    new, old = probe_summary(CFG, events)[0]["efficiency"], probe_summary(CFG, SHAPED)[0]["efficiency"]
    a2a = {eff: bp.predict(shaped, unshaped, work, plan, 60_000, 1.0, eff).phases["token_a2a"] for eff in (new, old)}
    lo = bp.network_time(unshaped, work.replace(collective_overhead_ms=0.0), plan, 60_000).seconds["token_a2a"]
    assert a2a[new] + lo == pytest.approx((a2a[old] + lo) * (0.005 - 0.004) / 0.005, rel=1e-6)
    assert 0 < a2a[new] < a2a[old] / 4
