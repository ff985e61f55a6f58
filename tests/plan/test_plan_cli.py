"""`hybridep plan` end to end through megatron_hybridep.cli.main."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import yaml

from megatron_hybridep.cli import main
from megatron_hybridep.plan.plan import Plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T = lambda n: os.path.join(ROOT, "configs", "topologies", f"{n}.yaml")  # noqa: E731
M = lambda n: os.path.join(ROOT, "configs", "models", f"{n}.yaml")  # noqa: E731


def run(capsys, *argv):
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_table_lists_every_candidate_and_marks_the_choice(capsys, tmp_path):
    out_path = tmp_path / "plan.json"
    rc, out, _ = run(capsys, "--topology", T("4dc_x_8"), "--model", M("paper-l"), "--compression-ratio", "50",
                     "--out", str(out_path))
    assert rc == 0
    rc, js, _ = run(capsys, "--topology", T("4dc_x_8"), "--model", M("paper-l"), "--compression-ratio", "50",
                    "--json")
    result = json.loads(js)
    labels = [c["label"] for c in result["candidates"]]
    assert len(labels) == 13  # 3 x 4 divisor combinations + replicated
    rows = [line for line in out.splitlines() if any(line[3:].startswith(lb + " ") for lb in labels)]
    assert len(rows) == len(labels)
    marked = [line for line in rows if line.startswith("*")]
    assert len(marked) == 1 and result["candidates"][0]["label"] in marked[0]
    saved = Plan.load(str(out_path))
    assert saved == Plan.from_dict(result["best"])
    saved.validate(32, 32)
    assert "paper model (tier a)" in out and "token a2a" in out


def test_options_change_the_workload(capsys, tmp_path):
    counts = np.full((4, 8), 16.0)
    counts[:, 0] = 100.0
    np.save(tmp_path / "r.npy", counts)
    rc, js, _ = run(capsys, "--topology", T("2dc_x_2"), "--model", M("tiny-cpu"), "--routing-counts",
                    str(tmp_path / "r.npy"), "--tokens-per-rank", "4096", "--json", "--cost", "ours")
    assert rc == 0
    d = json.loads(js)
    assert d["ep_size"] == 4
    assert "skewed routing from routing_counts" in d["candidates"][0]["cost"]["notes"]
    rc, out, _ = run(capsys, "--topology", T("2dc_x_2"), "--model", M("tiny-cpu"), "--skew", "1.5", "--top", "2")
    assert rc == 0 and "more (drop --top to see all)" in out and "skewed" in out
    rc, out, _ = run(capsys, "--topology", T("4dc_x_8"), "--model", M("paper-s"), "--ep-size", "all", "--top", "1")
    assert rc == 0 and out.count("EP group:") == 6 and "best over EP sizes" in out
    rc, out, _ = run(capsys, "--topology", T("4dc_x_8"), "--model", M("paper-s"), "--cost", "paper")
    assert rc == 0 and "replicated" not in out.split("EP group:")[1].split("* chosen")[0]


@pytest.mark.parametrize("argv, match", [
    (["--topology", "missing.yaml", "--model", M("paper-s")], r"missing.yaml: file not found; fix"),
    (["--model", M("paper-s")], r"--topology: required"),
    (["--topology", T("4dc_x_8"), "--model", M("paper-s"), "--ep-size", "12"], r"ep_size: 12 does not divide"),
    (["--topology", T("4dc_x_8"), "--model", M("paper-s"), "--ep-size", "x"], r"--ep-size: expected an integer"),
    (["--topology", T("4dc_x_8"), "--model", M("paper-s"), "--compression-ratio", "0.5"], r"compression_ratio"),
    (["--topology", T("1dc_x_8"), "--model", M("deepseek-v3-like"), "--ep-size", "8", "--routing-counts", "nope.npy"],
     r"routing_counts: nope.npy not found"),
])
def test_errors_exit_2_with_field_and_fix(capsys, argv, match):
    import re

    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert re.search(match, err), err


def test_slurm(capsys, tmp_path, monkeypatch):
    dcmap = tmp_path / "dcmap.yaml"
    dcmap.write_text(yaml.safe_dump({
        "datacenters": {"a": ["n[1-2]"], "b": ["n[3-4]"]},
        "levels": {"dc": {"bandwidth_gbps": 10, "uplink_gbps": 10}, "node": {"bandwidth_gbps": 100},
                   "gpu": {"bandwidth_gbps": 128}}}))
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-4]")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    rc, js, err = run(capsys, "--slurm", str(dcmap), "--model", M("paper-s"), "--json")
    assert rc == 0, err
    d = json.loads(js)
    assert d["world_size"] == 16 and d["ep_levels"] == {"dc": 2, "node": 2, "gpu": 4}


def test_memory_of_the_topology_refuses_plans_that_do_not_fit(capsys):
    """The issue-15 command: deepseek-v3-like on the paper's 4dc_x_8 (80 GB GPUs) fits no plan."""
    args = ("--topology", T("4dc_x_8"), "--model", M("deepseek-v3-like"), "--tokens-per-rank", "4096")
    rc, out, err = run(capsys, *args)
    assert rc == 2 and out == ""
    assert "memory_limit: no plan fits 80 GB per rank" in err and "4dc_x_8.yaml.memory_gb_per_gpu" in err
    assert "pipeline_model_parallel_size" in err
    rc, out, _ = run(capsys, *args, "--no-memory-check")
    assert rc == 0 and "\n-  " in out  # costed, marked as not fitting
    rc, out, _ = run(capsys, *args, "--pipeline-model-parallel-size", "4", "--distributed-optimizer",
                     "--memory-limit-gb", "2000")
    assert rc == 0 and "TP 1 x PP 4" in out and "EP group: 8 ranks = 8 gpu" in out  # a stage is one DC
    rc, out, err = run(capsys, "--topology", T("4dc_x_8"), "--model", M("deepseek-v3-like"),
                       "--pipeline-model-parallel-size", "3")
    assert rc == 2 and "pipeline_model_parallel_size: 3 does not divide the world size 32" in err


def test_borrowed_copies_flag_and_json(capsys):
    base = ("--topology", T("2dc_x_8"), "--model", M("paper-l"), "--tokens-per-rank", "8192", "--micro-batches",
            "16", "--json")
    for mode in ("iteration", "microbatch"):
        rc, out, _ = run(capsys, *base, "--borrowed-copies", mode)
        assert rc == 0
        cands = json.loads(out)["candidates"]
        hyb = [c for c in cands if c["kind"] == "domains" and max(c["domain_sizes"]) > 1]
        assert hyb and all(c["cost"]["borrowed_copies"] == mode for c in hyb)
        assert all("dense_grad_allreduce" in c["cost"]["phases"] for c in cands)
        assert all(c["cost"]["memory"]["dense_total"] > 0 if "dense_total" in c["cost"]["memory"] else True
                   for c in cands)
    with pytest.raises(SystemExit):
        run(capsys, *base, "--borrowed-copies", "sometimes")


def test_compressed_plans_state_their_share_and_the_cap(capsys):
    base = ["--topology", T("4dc_x_8"), "--model", M("paper-l"), "--tokens-per-rank", "8192",
            "--compression-ratio", "50", "--grad-compression-ratio", "10"]
    rc, out, _ = run(capsys, *base)
    assert rc == 0 and "domains dc4 gpu1 computes 75% of the routed tokens on compressed copies; no cap" in out
    rc, out, _ = run(capsys, *base, "--max-compressed-domain", "2", "--json")
    cands = json.loads(out)["candidates"]
    # domains over the cap stay, exact (no quality cost); only those within it may compress
    assert rc == 0 and {c["label"] for c in cands if c["compressed"]} <= {"domains dc2 gpu1", "domains dc1 gpu2"}
    assert any(c["label"] == "domains dc4 gpu1" and not c["compressed"] for c in cands)
    rc, out, _ = run(capsys, *base, "--codec-encode-ns", "1e6", "--codec-decode-ns", "0")  # a codec slower than links
    assert rc == 0 and "domains dc4 gpu1 exact" in out and "'exact' plans are priced at least as fast" in out
    assert "uses none" in out  # nothing runs compressed
    rc, out, _ = run(capsys, "--topology", T("4dc_x_8"), "--model", M("paper-l"), "--max-compressed-domain", "2")
    assert rc == 0 and "quality" not in out  # exact migration: nothing to say, nothing capped


def test_early_grad_return_is_priced_by_the_plan_command(capsys):
    base = ["--topology", T("4dc_x_8"), "--model", M("paper-l"), "--tokens-per-rank", "8192", "--micro-batches",
            "8", "--compression-ratio", "10", "--grad-compression-ratio", "4", "--borrowed-copies", "iteration",
            "--json"]
    costs = []
    for extra in (["--early-grad-return", "0"], ["--early-grad-return", "16"], []):
        rc, out, _ = run(capsys, *base, *extra)
        assert rc == 0
        costs.append({c["label"]: c["cost"] for c in json.loads(out)["candidates"]})
    whole, split, default = costs
    label = "domains dc2 gpu1"
    assert split[label]["raw"]["grad_return_rest"] > 0 == whole[label]["raw"]["grad_return_rest"]
    assert split[label]["phases"]["grad_return"] != whole[label]["phases"]["grad_return"]
    assert default == split  # pretrain_moe.py's default (auto) splits compressed returns at 16x
    at = base.index("--grad-compression-ratio") + 1
    past_cap = [*base[:at], "50", *base[at + 1:]]
    rc, out, _ = run(capsys, *past_cap)
    assert rc == 0  # at 50x a 16x rest would outweigh one return: auto returns once
    assert {c["label"]: c["cost"] for c in json.loads(out)["candidates"]}[label]["raw"]["grad_return_rest"] == 0
