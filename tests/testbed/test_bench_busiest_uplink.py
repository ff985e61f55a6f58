"""The bench's WAN-bytes comparison is like with like: the busiest uplink measured against the cost
model's busiest uplink (bench/analysis.py make_row), not the mean over uplinks."""

import csv
import shutil
from pathlib import Path

RECORDED = (Path(__file__).resolve().parents[2] / "docs" / "results" / "layout_bench"
            / "4dc_x_2_deep_50mbit_m8_w10g4b16_reno_rounds2_compressed_ties")


def test_a_middle_pipeline_stage_is_the_busiest_uplink(tmp_path):
    from megatron_hybridep.bench.reanalyse import reanalyse

    copy = tmp_path / "run"
    shutil.copytree(RECORDED, copy)
    reanalyse(copy)
    with open(copy / "bench.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:  # the busiest uplink's busier direction is at least the mean of either direction
        busiest = float(r["wan_busiest_mb"])
        assert busiest >= max(float(r["wan_tx_mb"]), float(r["wan_rx_mb"])) * (1 - 1e-9), r
    # 4 stages, one per DC: the uplinks carry 1, 2, 2, 1 stage boundaries' bytes (mean 1.5, busiest 2)
    pp = next(r for r in rows if r["system"] == "pp" and r["point"] == "1")
    assert abs(float(pp["wan_busiest_mb"]) / float(pp["wan_tx_mb"]) - 4 / 3) < 0.1, pp


def test_a_skewed_router_prices_eps_all_to_all_by_its_busiest_link():
    """The ranks' routing (bench/worker.py records it; Session.routing feeds it to the prediction) puts
    the token all-to-all on the busiest DC link: experts of DC 0 taking 1.5x their share make its
    downlink (dispatch) and uplink (combine) carry 1.5x the balanced bytes, and the all-to-all 1.5x."""
    import numpy as np

    from megatron_hybridep.bench import predict as bp
    from megatron_hybridep.plan.phases import Phase

    model = bp.load_model(str(Path(__file__).resolve().parents[2] / "configs" / "models" / "bench-moe-deep.yaml"))
    topo = bp.testbed_topology(4, 2, 9.6, 40_000)
    work = bp.Calibration(0.1, 0.05, 2048).workload(model, 1024, 32, micro_batches=8, dense_params=35_000)
    plan = bp.system_plan("ep", topo, model.num_experts)
    rows = 1024 * model.top_k
    hot = np.full(model.num_experts, (rows - 4 * 1.5 * rows / 16) / 12)
    hot[:4] = 1.5 * rows / 16  # DC 0 holds experts 0-3 (2 per rank)
    skewed = np.broadcast_to(hot, (model.num_moe_layers, 8, model.num_experts)).copy()
    even = work.replace(routing_counts=np.full_like(skewed, rows / 16))
    a2a = {name: bp.network_time(topo, w, plan, 35_000).seconds[Phase.TOKEN_A2A]
           for name, w in (("balanced", work), ("recorded balanced", even),
                           ("skewed", work.replace(routing_counts=skewed)))}
    assert abs(a2a["recorded balanced"] / a2a["balanced"] - 1) < 0.02, a2a
    assert abs(a2a["skewed"] / a2a["balanced"] - 1.5) < 0.05, a2a


def test_the_recorded_routing_brings_eps_1024_token_row_within_10_percent(tmp_path):
    """4 DCs x 2 at 10 Mbit/s (2026-12-02): with the router's skew from EP's unshaped run, EP is predicted
    within 10% at both points; the same run with the routing dropped from its events misses at 1024 tokens
    by the balanced all-to-all's share (-15.7% recorded in the abba run before the skew was priced)."""
    import json

    from megatron_hybridep.bench.reanalyse import reanalyse

    run = RECORDED.parent / "4dc_x_2_deep_10mbit_m8_w10g4b16_reno_rounds2_routing"

    def ep_errors(copy: Path) -> dict[str, float]:
        reanalyse(copy)
        with open(copy / "bench.csv", newline="") as f:
            return {r["tokens"]: float(r["pred_error_pct"]) for r in csv.DictReader(f) if r["system"] == "ep"}

    shutil.copytree(run, tmp_path / "skew")
    with_skew = ep_errors(tmp_path / "skew")
    assert set(with_skew) == {"32", "1024"} and all(abs(e) <= 10 for e in with_skew.values()), with_skew
    balanced = tmp_path / "balanced"
    shutil.copytree(run, balanced)
    for log in balanced.glob("logs/point*/rank0.log"):
        lines = []
        for line in log.read_text().splitlines():
            if line.startswith("BENCH "):
                e = json.loads(line[len("BENCH "):])
                e.pop("routing", None)
                line = "BENCH " + json.dumps(e)
            lines.append(line)
        log.write_text("\n".join(lines) + "\n")
    without = ep_errors(balanced)
    assert without["1024"] < -10 and with_skew["1024"] - without["1024"] > 5, (with_skew, without)
