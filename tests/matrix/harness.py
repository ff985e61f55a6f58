"""Shared pieces of the configuration matrix: a tiny model, a plan whose domains cross DCs, and
one run of pretrain_moe's CPU loop (megatron_hybridep.train.cpu_loop.run with parsed args, the
user path) on N gloo ranks, returning every rank's losses and final parameters.

Each configuration's test runs HybridEP and Megatron's alltoall EP (the oracle) with the same flags
and compares losses at every iteration and every parameter after the last one."""

from __future__ import annotations

import math
import os

import torch

from megatron_hybridep.train.launch import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESET = os.path.join(REPO, "configs", "presets", "cpu_demo.yaml")
TOPOLOGY_2DC = os.path.join(REPO, "configs", "topologies", "2dc_x_2.yaml")

# 2 layers, hidden 32, seq 32: start-up dominates, so each run costs seconds on 2 cores.
TINY = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--moe-ffn-hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "2", "--lr-warmup-iters", "1", "--log-interval", "100"]
ITERS = 3

# float64 (--hybridep-fp64): HybridEP sums the same terms as alltoall in another order, so the
# difference is a few float64 roundings, amplified at most by the 3 Adam steps (an update is
# lr * m / sqrt(v): relative gradient noise eps64 changes it by ~eps64 * lr). 1e-9 is 10^6 x eps64
# and still 10^5 x below a bf16 rounding: any real mismatch (a dropped or duplicated token, a wrong
# gradient) is orders of magnitude larger.
FP64_TOL = 1e-9


def _run(ctx, argv: list[str]) -> tuple[list[float], dict[str, torch.Tensor]]:  # noqa: ANN001 - RankContext
    from megatron_hybridep.megatron.arguments import parse
    from megatron_hybridep.train import cpu_loop

    summary = cpu_loop.run(parse(argv, default_config=PRESET), collect_params=True)
    return summary.losses, {name: p.double() for name, p in summary.params.items()}


def train(world: int, flags: list[str], dispatcher: str, plan: str | None = None, topology: str | None = None,
          iters: int = ITERS, timeout: float = 300) -> list[tuple[list[float], dict[str, torch.Tensor]]]:
    """Every rank's (losses, parameters) after ``iters`` iterations of the tiny model with ``flags``."""
    argv = [*TINY, "--train-iters", str(iters), "--hybridep-nproc", str(world), *flags,
            "--moe-token-dispatcher-type", dispatcher]
    if plan is not None:
        argv += ["--hybridep-plan", plan]
    if topology is not None:
        argv += ["--hybridep-topology", topology]
    return run_ranks(_run, world, argv, timeout=timeout)


def write_topology(path: str, dcs: int, per_dc: int) -> str:
    """The 2dc_x_2 preset's links with other level counts (DC = outer level, ranks contiguous)."""
    import yaml

    with open(TOPOLOGY_2DC) as f:
        spec = yaml.safe_load(f)
    spec["name"] = f"{dcs}dc_x_{per_dc}"
    spec["world_size"] = dcs * per_dc
    spec["levels"][0]["count"], spec["levels"][1]["count"] = dcs, per_dc
    with open(path, "w") as f:
        yaml.safe_dump(spec, f)
    return path


def write_cross_dc_plan(path: str, num_experts: int = 8) -> str:
    """The EP group (4 ranks: 2 DCs x 2) in domains of one rank per DC: every domain crosses the
    DC boundary (borrowed experts travel over the WAN) and the rails stay inside a DC."""
    from megatron_hybridep.plan.plan import Plan

    plan = Plan.grid((2, 2), (2, 1), num_experts, ("dc", "gpu"))
    assert all(len({r // 2 for r in domain}) == 2 for domain in plan.domains)  # each domain spans both DCs
    plan.save(path)
    return path


def max_differences(a: list, b: list) -> tuple[float, float]:
    """(largest loss difference at any iteration on any rank, largest parameter difference)."""
    loss = param = 0.0
    for (la, pa), (lb, pb) in zip(a, b, strict=True):
        assert len(la) == len(lb), (la, lb)
        for x, y in zip(la, lb, strict=True):
            assert math.isnan(x) == math.isnan(y), (la, lb)  # NaN: a rank without the last pipeline stage
            if not math.isnan(x):
                loss = max(loss, abs(x - y))
        assert pa.keys() == pb.keys()
        for name in pa:
            param = max(param, (pa[name] - pb[name]).abs().max().item())
    return loss, param


def assert_within_oracle_rounding(hybridep: list, oracle: list, exact: list, what: str = "") -> None:
    """A half-precision HybridEP run against the oracle (alltoall, the same flags), held to the
    oracle's own error against the float64 run of the job (``exact``): were HybridEP as accurate as
    the oracle, the two would differ by at most twice that (the triangle inequality), whichever way
    each one's rounding went. (Held at 1x before, the loss failed at 1.4x on a host whose rounding differed.)"""
    loss_err, param_err = max_differences(oracle, exact)  # what the half precision costs alltoall itself
    assert 0 < param_err < 0.1, param_err  # the oracle really ran in half precision, and trained
    loss, param = max_differences(hybridep, oracle)
    assert loss <= 2 * loss_err and param <= 2 * param_err, (
        f"hybridep vs alltoall{what}: loss {loss:.3g} (oracle's own error {loss_err:.3g}, bound twice that), "
        f"params {param:.3g} (oracle's own error {param_err:.3g}, bound twice that)")


def assert_same_training(hybridep: list, alltoall: list, tol: float = FP64_TOL) -> None:
    """HybridEP matches the oracle: losses at every iteration and every parameter within ``tol``,
    and the run actually trained (parameters moved, losses finite on the last pipeline stage)."""
    assert any(not math.isnan(x) for losses, _ in alltoall for x in losses), "no rank reported a loss"
    loss, param = max_differences(hybridep, alltoall)
    assert loss <= tol and param <= tol, f"hybridep vs alltoall: loss diff {loss:.3g}, param diff {param:.3g} > {tol}"
