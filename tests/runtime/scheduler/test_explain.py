"""`hybridep plan --explain` says why the chosen plan wins, with numbers from the cost model."""

import os

from megatron_hybridep.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_explain_names_the_deciding_phases(capsys):
    rc = main(["plan", "--topology", os.path.join(REPO, "configs/topologies/2dc_x_8.yaml"),
               "--model", os.path.join(REPO, "configs/models/paper-s.yaml"), "--tokens-per-rank", "16384",
               "--explain"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "why domains" in out and "vs plain EP ep (S=1)" in out
    assert "token_a2a_fwd saves" in out and "expert_allgather costs" in out
    assert "x slower" in out and "held copies" in out and "memory per rank" in out
    assert "borrowed copies: iteration (held borrowed copies need" in out and "limit 80 GB: iteration" in out


def test_explain_prices_the_mode_that_runs(capsys):
    """16 micro-batches: copies kept for the iteration pay the gather and return once; forced per
    micro-batch they pay them 16 times and the plan loses its lead."""
    args = ["plan", "--topology", os.path.join(REPO, "configs/topologies/2dc_x_8.yaml"),
            "--model", os.path.join(REPO, "configs/models/paper-l.yaml"), "--tokens-per-rank", "8192",
            "--micro-batches", "16", "--explain", "--no-replicated"]
    assert main(args) == 0
    once = capsys.readouterr().out
    assert "gathered once per iteration, gradients returned once" in once
    assert main(args + ["--borrowed-copies", "microbatch"]) == 0
    every = capsys.readouterr().out
    assert "forced" in every or "why ep" in every

    def speedup(out):
        line = next(x for x in out.splitlines() if x.startswith("* chosen"))
        return float(line.rsplit(";", 1)[1].split("x")[0])

    assert speedup(once) > 5 and speedup(every) < 1.1
