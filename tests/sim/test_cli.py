"""`hybridep simulate`: one configuration, sweeps (CSV + PNG), the paper reproduction, errors."""

from __future__ import annotations

import csv
import json

import pytest

from megatron_hybridep.cli import main
from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.sim.sweep import (
    SweepSpec,
    parse_list,
    parse_policy,
    policy_plan,
    run_sweep,
    scaled_topology,
)

from .helpers import two_level, workload

TOPO = "configs/topologies/2dc_x_8.yaml"
MODEL = "configs/models/paper-s.yaml"


@pytest.fixture(autouse=True)
def _repo(monkeypatch):
    import os

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_one_configuration_prints_the_breakdown(capsys, tmp_path):
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    rc = main(["simulate", "--topology", TOPO, "--model", MODEL, "--plan", "2,1", "--compression-ratio", "50",
               "--micro-batches", "2", "--trace", str(trace), "--png", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    for text in ("domains dc2 gpu1", "token_a2a_fwd", "expert_allgather", "grad_return", "total", "tier-b model",
                 "timeline", "gathered once per iteration"):
        assert text in out, text
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e["tid"] == 2 and e["name"] == "gather" for e in events)  # the async gathers
    assert png.stat().st_size > 1000


def test_json_output_is_consistent(capsys):
    assert main(["simulate", "--topology", TOPO, "--model", MODEL, "--plan", "ep", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["plan"] == "ep (S=1)"
    assert sum(d["phases"].values()) == pytest.approx(d["total"])
    assert d["tier_b"]["total"] > 0


def test_errors_name_the_field_and_the_fix(capsys):
    assert main(["simulate", "--model", MODEL]) == 2
    err = capsys.readouterr().err
    assert "--topology" in err and "fix:" in err
    assert main(["simulate", "--topology", TOPO, "--model", MODEL, "--plan", "3,1,1"]) == 2
    err = capsys.readouterr().err
    assert "--plan" in err and "one S per level" in err
    assert main(["simulate", "--topology", TOPO, "--model", MODEL, "--policy", "fixed-q:1"]) == 2
    assert "policy" in capsys.readouterr().err


def test_sweep_writes_csv_and_png(capsys, tmp_path):
    out_csv, out_png = tmp_path / "s.csv", tmp_path / "s.png"
    rc = main(["simulate", "--topology", "configs/topologies/1000dc_x_8.yaml", "--model", MODEL,
               "--sweep-dcs", "2,4,8", "--sweep-bandwidth", "1,100", "--policy", "fixed-domain:4", "--policy",
               "fixed-p:0.5", "--policy", "planner", "--compression-ratio", "50", "--csv", str(out_csv),
               "--png", str(out_png), "--no-progress", "--jobs", "2"])
    assert rc == 0, capsys.readouterr().err
    rows = list(csv.DictReader(out_csv.open()))
    assert len(rows) == 3 * 2 * 3
    for r in rows:
        assert float(r["speedup_vs_ep"]) == pytest.approx(float(r["ep_iteration_s"]) / float(r["iteration_s"]))
        if r["policy"] == "fixed-domain:4":
            assert r["domain_sizes"].split("x")[0] == str(min(4, int(r["dcs"])))
        if r["policy"] == "fixed-p:0.5":
            assert float(r["p_dc"]) == pytest.approx(0.5) or r["dcs"] == "2" and float(r["p_dc"]) == 0.5
    assert out_png.stat().st_size > 1000


def test_policies():
    topo = two_level(8, 2)
    w = workload(16)
    assert policy_plan("fixed-domain", 3, topo, w, 16).domain_sizes == (2, 1)   # largest divisor of 8 <= 3
    assert policy_plan("fixed-p", 0.75, topo, w, 16).domain_sizes == (2, 1)     # S = (1 - p) N = 2
    assert policy_plan("ep", None, topo, w, 16).domain_size == 1
    assert policy_plan("replicated", None, topo, w, 16).kind == "replicated"
    best = policy_plan("best", None, topo, w.replace(compression_ratio=100), 16)
    from megatron_hybridep.plan.planner import enumerate_plans
    from megatron_hybridep.sim.simulate import simulate

    times = [simulate(topo, w.replace(compression_ratio=100), p).total for p in enumerate_plans(topo.ep_layout(16), 16)]
    assert simulate(topo, w.replace(compression_ratio=100), best).total == pytest.approx(min(times))
    with pytest.raises(PlanError, match="fixed-p"):
        parse_policy("fixed-p:1.5")
    with pytest.raises(PlanError, match="needs a value"):
        parse_policy("fixed-domain")
    assert parse_list("2:1000:4", int, "x") == (2, 16, 126, 1000)
    with pytest.raises(PlanError, match="--sweep-dcs"):
        parse_list("a,b", int, "--sweep-dcs")


def test_scaled_topology_drops_overrides_outside():
    from megatron_hybridep.plan.topology import Topology

    base = Topology.from_yaml("configs/topologies/1000dc_x_8.yaml")
    t = scaled_topology(base, 4, 25.0)
    assert t.levels[0].count == 4 and t.levels[0].bandwidth_gbps == 25.0 and t.levels[0].uplink_gbps == 25.0
    assert [(o.a, o.b) for o in t.levels[0].overrides] == [(0, 1), (2, 3)]


def test_sweep_speedup_grows_as_bandwidth_shrinks_when_experts_are_cheap():
    """The paper's trend: with small (compressed) experts and heavy token traffic, a whole-world domain
    beats EP by more on slower links."""
    spec = SweepSpec(two_level(4, 2), workload(8, compression_ratio=200, grad_compression_ratio=200,
                                               tokens_per_rank=8192), (4,), (1.0, 10.0, 100.0),
                     ("fixed-domain:4",), ep_span="all")
    rows = run_sweep(spec)
    sp = [r["speedup_vs_ep"] for r in sorted(rows, key=lambda r: r["wan_gbps"])]
    assert sp[0] > sp[1] > sp[2] > 1


def test_paper_reproduction_prints_the_table(capsys, tmp_path):
    rc = main(["simulate", "--paper-repro", "--sweep-dcs", "8,1000", "--sweep-bandwidth", "10",
               "--out-dir", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "1.05x-1.45x" in out and "1.31x-3.76x" in out and "ours (full)" in out
    for v in ("full", "forward"):
        rows = list(csv.DictReader((tmp_path / f"paper_repro_{v}.csv").open()))
        assert {r["dcs"] for r in rows} == {"8", "1000"}
        assert (tmp_path / f"paper_repro_{v}.png").stat().st_size > 1000
        # fixed domain of 4 DCs at 1000 DCs: at most N / (N - S) = 1.004x, whatever the bandwidth
        fd = [float(r["speedup_vs_ep"]) for r in rows if r["dcs"] == "1000" and r["policy"] == "fixed-domain:4"]
        assert fd and max(fd) <= 1000 / 996 + 1e-9
