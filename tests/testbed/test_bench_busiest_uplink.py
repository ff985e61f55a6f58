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
