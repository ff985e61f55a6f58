"""Run pretrain_moe's CPU loop on test ranks and compare two runs: the user's path, exactly.

``train`` runs inside a rank (``run_ranks(train, world, argv)``); ``compare`` checks a candidate run
against the oracle run (Megatron's alltoall EP with the same flags) at every iteration's loss and
every parameter after the last step. Flags come on top of the CPU demo preset shrunk to ``TINY``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESET = os.path.join(REPO, "configs", "presets", "cpu_demo.yaml")
# small enough that a 4-rank run of a few iterations takes seconds on 2 cores
TINY = ("--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--moe-ffn-hidden-size", "64",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--lr-warmup-iters", "1", "--log-interval", "1000")


def train(ctx: Any, argv: Sequence[str]) -> dict[str, Any]:
    """One rank of a CPU-loop run: losses per iteration, final parameters, inter-DC bytes/iter."""
    from megatron_hybridep.megatron.arguments import parse
    from megatron_hybridep.train import cpu_loop

    summary = cpu_loop.run(parse([*TINY, *argv], default_config=PRESET), collect_params=True)
    return {"losses": summary.losses, "params": summary.params,
            "inter_dc_per_iter": summary.inter_dc_bytes / max(1, summary.iterations), "plan": summary.plan,
            "inter_dc_by_phase": {k: v / max(1, summary.iterations) for k, v in summary.inter_dc_by_phase.items()}}


def max_param_diff(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, str]:
    """Largest |a - b| over every parameter, and its name (the name sets must match)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    worst, name = 0.0, ""
    for k in a:
        d = (a[k].double() - b[k].double()).abs().max().item()
        if d > worst or not name:
            worst, name = d, k
    return worst, name


def compare(oracle: list[dict[str, Any]], candidate: list[dict[str, Any]], tol: float) -> None:
    """Every rank: the same losses at every iteration and every parameter within ``tol``."""
    for rank, (o, c) in enumerate(zip(oracle, candidate, strict=True)):
        assert len(o["losses"]) == len(c["losses"]) > 0
        for i, (x, y) in enumerate(zip(o["losses"], c["losses"], strict=True)):
            assert math.isfinite(x) and abs(x - y) <= tol, f"rank {rank} iteration {i + 1}: loss {y} vs {x}"
        diff, name = max_param_diff(o["params"], c["params"])
        assert diff <= tol, f"rank {rank}: {name} differs by {diff:.3g} (tolerance {tol:.3g})"
