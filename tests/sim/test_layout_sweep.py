"""Sweeps over pipeline layouts (sim/sweep.py: pp:K, layout, megatron), at the same global batch."""

from __future__ import annotations

import csv
import os

import pytest

from megatron_hybridep.cli import main
from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.layout import is_hybridep
from megatron_hybridep.plan.planner import choose_plan
from megatron_hybridep.sim.simulate import simulate
from megatron_hybridep.sim.sweep import SweepSpec, parse_policy, pipeline_point, pipeline_sizes, run_sweep
from tests.sim.helpers import two_level, workload

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POLICIES = ("planner", "pp:2", "pp:4", "layout", "megatron")


def test_pp_policies_parse():
    assert parse_policy("pp:4") == ("pp", 4.0)
    assert parse_policy("layout") == ("layout", None) and parse_policy("megatron") == ("megatron", None)
    for bad in ("pp", "pp:x", "pp:0", "layout:2"):
        with pytest.raises(PlanError):
            parse_policy(bad)


def test_pipeline_sizes_divide_the_layers_and_keep_stages_inside_dc_boundaries():
    # 16 DCs x 8, 12 layers: PP 3, 6 and 12 do not divide the 128 ranks
    assert pipeline_sizes(two_level(16, 8), workload(128, num_moe_layers=12)) == (1, 2, 4)
    # 3 DCs x 4: PP 2 (stages of 6 ranks) and 4 (3 ranks) straddle DCs; PP 3 (one DC) and 6 (half a DC) do not
    assert pipeline_sizes(two_level(3, 4), workload(12, num_moe_layers=4)) == (1,)
    assert pipeline_sizes(two_level(3, 4), workload(12, num_moe_layers=6)) == (1, 3, 6)


def test_a_pipeline_point_keeps_the_global_batch_and_spans_one_stage():
    topo, w = two_level(4, 2), workload(8, num_moe_layers=4, micro_batches=2)
    wk, G = pipeline_point(topo, w, 2, "all")
    assert (wk.pipeline_model_parallel_size, wk.micro_batches, wk.tokens, G) == (2, 4, w.tokens, 4)
    assert pipeline_point(topo, w, 4, "default")[1] == 2  # a PP-4 stage is one DC of 2 ranks


def _rows(work, wan):
    spec = SweepSpec(two_level(4, 2), work, (4,), (wan,), POLICIES)
    return {r["policy"]: r for r in run_sweep(spec)}


def test_pipeline_stages_win_when_experts_are_large_and_tokens_few():
    # 8 x 8.4M-parameter experts, 256 tokens of 256 per micro-batch, 1 Gbit/s: tokens across DCs (EP),
    # experts across DCs (hybridep) and expert gradients across DCs (replicated) all cost more than
    # one stage's activations
    w = workload(8, hidden_size=256, ffn_hidden_size=16384, num_moe_layers=4, tokens_per_rank=256, micro_batches=8)
    rows = _rows(w, 1.0)
    assert rows["layout"]["pp"] > 1 and rows["layout"]["micro_batches"] == 8 * rows["layout"]["pp"]
    assert rows["layout"]["iteration_s"] < 0.6 * rows["planner"]["iteration_s"]  # about 2x
    # hybridep does not pay: the best layout with it is the best without it
    assert rows["layout"]["plan"] == rows["megatron"]["plan"] and rows["layout"]["pp"] == rows["megatron"]["pp"]
    pp = rows[f"pp:{rows['layout']['pp']}"]
    assert pp["iteration_s"] == pytest.approx(rows["layout"]["iteration_s"])


def test_hybridep_inside_a_stage_wins_when_tokens_dominate():
    # 16384 tokens x 512 per rank, 262k-parameter experts, 1 Gbit/s: domains across the DCs of a stage
    w = workload(8, hidden_size=512, ffn_hidden_size=256, num_moe_layers=4, tokens_per_rank=16384,
                 micro_batches=1, t_pre_ms=None)
    rows = _rows(w, 1.0)
    best, base = rows["layout"], rows["megatron"]
    topo = two_level(4, 2, wan=1.0)
    wk, G = pipeline_point(topo, w, best["pp"], "all")
    plan = choose_plan(topo, wk, G).best
    assert plan.label == best["plan"] and is_hybridep(plan)
    assert best["iteration_s"] == pytest.approx(simulate(topo, wk, plan).total)
    assert base["iteration_s"] > 1.2 * best["iteration_s"]


def test_sweep_cli_prints_the_pp_column_and_uniform_links_drop_overrides(capsys, tmp_path):
    topo = os.path.join(ROOT, "configs", "topologies", "1000dc_x_8.yaml")
    model = os.path.join(ROOT, "configs", "models", "paper-l.yaml")
    base = ["simulate", "--topology", topo, "--model", model, "--sweep-dcs", "8", "--policy", "pp:2",
            "--policy", "layout", "--no-progress", "--ep-span", "default"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:6] == ["DCs", "WAN", "Gbit/s", "policy", "PP", "plan"]
    pp_rows = [line.split() for line in out.splitlines() if "pp:2" in line]
    assert pp_rows and pp_rows[0][3] == "2"

    def ep_seconds(*extra):
        path = tmp_path / "rows.csv"
        assert main(base + ["--csv", str(path), *extra]) == 0
        with open(path, encoding="utf-8") as f:
            return float(next(csv.DictReader(f))["ep_iteration_s"])

    # DC 7's slow link to DC 0 (2.5 Gbit/s, 40 ms) lies inside an 8-DC world: dropping it is faster
    assert ep_seconds("--uniform-links") < ep_seconds()
