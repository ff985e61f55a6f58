"""`hybridep bench --smoke` end to end on the testbed (root): every system at every point with a
positive step time, HybridEP sends fewer bytes across the WAN than alltoall EP, outputs written,
the testbed torn down."""

from __future__ import annotations

import csv
import json
import time

import pytest
from testbed_helpers import leftovers, run_to_end

from megatron_hybridep.testbed.bench import SMOKE

pytestmark = pytest.mark.slow

LIMIT_S = 90


def test_bench_smoke_end_to_end(root_host, tmp_path):
    out = tmp_path / "bench"
    t0 = time.monotonic()
    proc, stdout = run_to_end(["-m", "megatron_hybridep", "bench", "--smoke", "--out", str(out)], LIMIT_S,
                              "bench --smoke")
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, stdout[-4000:]
    assert leftovers(f"hep-{proc.pid}") == []  # namespaces and state file gone

    with open(out / "bench.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    systems = {"ep", "replicated", "hybridep", "hybridep-compressed"}
    cells = {(int(r["point"]), r["system"]) for r in rows}
    assert cells == {(p, s) for p in range(SMOKE["points"]) for s in systems}, cells
    for r in rows:
        assert float(r["median_s"]) > 0 and float(r["min_s"]) > 0, r
        assert float(r["predicted_s"]) > 0 and float(r["wan_tx_mb"]) > 0, r

    def wan(system: str, point: int | None = None) -> float:
        return sum(float(r["wan_tx_mb"]) + float(r["wan_rx_mb"]) for r in rows
                   if r["system"] == system and (point is None or int(r["point"]) == point))

    top = SMOKE["points"] - 1
    assert wan("hybridep", top) < wan("ep", top), rows  # link counters: fewer bytes cross the WAN
    assert wan("hybridep") < wan("ep")
    assert wan("hybridep-compressed", top) < wan("hybridep", top)  # compressed weights and gradients
    assert (out / "bench.png").stat().st_size > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["command"].startswith("python -m megatron_hybridep bench")
    assert "command: python -m megatron_hybridep bench" in stdout
    print(f"bench --smoke: {elapsed:.1f} s\n{stdout[-3000:]}")


# ---- no root needed: the sweep, option checks and the prediction arithmetic ----------------------
def _args(**kw):
    import argparse

    from megatron_hybridep.testbed.bench import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = [x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    return parser.parse_args(argv)


def test_default_sweep_spans_32x_as_micro_batch_times_seq():
    from megatron_hybridep.testbed.bench import resolve

    cfg = resolve(_args())
    tokens = [p["tokens"] for p in cfg.points]
    assert tokens == [128, 256, 512, 1024, 2048, 4096]
    assert all(p["micro_batch"] * p["seq"] == p["tokens"] for p in cfg.points)
    assert "--rate 50mbit" in cfg.command() and "--points 6" in cfg.command()
    assert cfg.systems == ["ep", "replicated", "hybridep", "hybridep-compressed"]
    assert "--compression-ratio 50" in cfg.command() and "--burst-ms 1" in cfg.command()


@pytest.mark.parametrize("kw, field", [
    ({"systems": "ep,bogus"}, "--systems"), ({"systems": "hybridep"}, "--systems"), ({"dcs": 1}, "--dcs"),
    ({"min_tokens": 100, "seq": 64}, "--min-tokens"), ({"points": 1}, "--points"), ({"rate": "fast"}, "--rate"),
    ({"ranks_per_dc": 1}, "--systems replicated"), ({"dcs": 3}, "--model"), ({"burst_ms": -1}, "--burst-ms"),
    ({"compression_ratio": 1}, "--compression-ratio"),
])
def test_bad_options_name_the_field_and_the_fix(kw, field):
    from megatron_hybridep.testbed.bench import BenchError, resolve

    with pytest.raises(BenchError, match=field) as exc:
        resolve(_args(**kw))
    assert "fix" in str(exc.value)


def test_prediction_adds_the_shaped_network_to_the_unshaped_step():
    from megatron_hybridep.testbed import bench_predict as bp

    shaped = bp.testbed_topology(2, 2, 38.0, 20_000.0)
    unshaped = bp.testbed_topology(2, 2, 3_000.0, 20_000.0)
    work = bp.Calibration(t_pre_s=0.05, expert_fwd_s=0.02, expert_rows=16384).workload(bp.BUILTIN, 4096, 128)
    ep = bp.predict(shaped, unshaped, work, bp.system_plan("ep", shaped, 8), 60_000, 0.5)
    # EP: 4 all-to-alls x 2 layers; a DC uplink carries half of its 2 ranks' dispatched bytes
    a2a_bytes = 4 * 2 * 2 * (4096 * 2 * 64 * 4) / 2
    assert ep.phases["token_a2a"] == pytest.approx(a2a_bytes / (38e6 / 8) - a2a_bytes / (3e9 / 8), rel=1e-6)
    assert ep.total == pytest.approx(0.5 + sum(ep.phases.values())) == pytest.approx(ep.uncalibrated_total)
    # calibrated: the shaped all-to-alls at the probed share of the rate, nothing else changes
    slow = bp.predict(shaped, unshaped, work, bp.system_plan("ep", shaped, 8), 60_000, 0.5, a2a_efficiency=0.8)
    assert slow.phases["token_a2a"] == pytest.approx(a2a_bytes / (0.8 * 38e6 / 8) - a2a_bytes / (3e9 / 8), rel=1e-6)
    assert slow.uncalibrated_total == pytest.approx(ep.total)
    assert slow.phases["dense_grad_allreduce"] == ep.phases["dense_grad_allreduce"]
    domains = next(p for p in bp.candidate_plans(shaped, 8) if p.domain_sizes == (2, 1))
    hyb = bp.predict(shaped, unshaped, work, domains, 60_000, 0.5)
    assert hyb.phases["token_a2a"] == 0.0  # domains across the DCs: no token crosses the WAN
    assert hyb.phases["grad_return"] > 0 and hyb.total < ep.total
    assert hyb.dc_uplink_bytes < ep.dc_uplink_bytes
    # the gradient return is blocking: all of its shaped time is charged; a DC uplink carries both of its
    # ranks' (S-1) x 2 experts x 2 layers of gradients (fp32)
    grad = 2 * 2 * 2 * bp.BUILTIN.expert_params * 4
    assert hyb.phases["grad_return"] == pytest.approx(grad / (38e6 / 8) - grad / (3e9 / 8), rel=1e-6)
    comp_work = bp.Calibration(0.05, 0.02, 16384).workload(bp.BUILTIN, 4096, 128, compression_ratio=50.0)
    comp = bp.predict(shaped, unshaped, comp_work, domains, 60_000, 0.5)
    assert comp.phases["grad_return"] < hyb.phases["grad_return"] / 10
    rep = bp.predict(shaped, unshaped, work, bp.system_plan("replicated", shaped, 8), 60_000, 0.5)
    assert comp.total < rep.total  # replicated all-reduces full expert gradients over the WAN
