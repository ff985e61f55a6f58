"""`hybridep bench`: HybridEP against Megatron's alltoall EP and the replicated-experts plan, training
the real Megatron GPT-MoE on the emulated multi-DC testbed (network namespaces + tc; needs root).

    python -m megatron_hybridep bench                      # defaults below, ~4 min on 2 quiet cores
    python -m megatron_hybridep bench --smoke              # 2 points, tiny batches, < 60 s
    python -m megatron_hybridep bench --rate 100mbit --points 4 --min-tokens 256 --out runs/b1

One testbed (D DCs x K ranks), one launch of the rank workers (bench/worker) per system run (fresh
processes, forked from the warm host: gloo never frees old process groups' threads), steered by the
parent over a control socket (bench/control); rank logs in <out>/logs/point<i>/run<k>. Point by
point, highest traffic first (tokens per rank =
micro_batch x seq, --points values over a 32x range, so the token traffic per rank spans 32x like the
paper's 6..192 MB), system by system (EP first, then replicated, HybridEP with exact migration, and
HybridEP with weights and returned gradients top-k compressed, --compression-ratio and
--grad-compression-ratio):
1. WAN unshaped: build the system, warm up, K iterations -> the unshaped step time the prediction
   starts from, and (EP) the compute the cost model is fed: T_pre and the expert speed;
2. HybridEP's plan is the planner's (plan/planner.py, its own cost model) for a Topology of the
   testbed (bandwidth = TCP goodput of the rate) and a Workload of the model, tokens and step 1
   (for the compressed variant: with the codec's bytes);
3. WAN shaped to --rate: warm up, K timed iterations; the uplink byte counters over exactly the
   timed window; the prediction (bench/predict) next to it.
Measuring each system unshaped and shaped back to back keeps the machine's load (shared cores)
out of the comparison as far as possible; --rounds R repeats a point's systems R times, interleaved
(rows pool the rounds); the report states the load average of every point.
Modules: bench/config (options, sweep), bench/session (the parent's side of the protocol, shaping,
planner), bench/worker (a rank), bench/predict (cost model -> predicted step), bench/analysis and
bench/report (rows, probe, targets, CSV/PNG/table).

Default WAN rate: 50 Mbit/s per DC uplink. The paper's 10 Gbit/s links made EP communication-bound
on A800s: at its top point (192 MB of token traffic per rank) HybridEP was 5.5x faster than EP, at its
lowest (6 MB) 1.03x. Scaling the link by compute speed alone (a CPU core is ~1e4x slower than an
A800: 10 Gbit/s / 1e4 = 1 Mbit/s) would ignore that this model is ~300x smaller per token than the
paper's (hidden 64 vs 512-1024, fp32), i.e. ships far more bytes per FLOP, and would make one EP step
take a minute. What must carry over is the ratio (EP's cross-DC token time) / (compute), which sets
the speedup. Measured here on a quiet machine (2 DCs x 2 ranks, 2 cores, 4096 tokens per rank): a
step computes in ~0.5 s and EP moves 17.4 MB per DC uplink and direction, ~3.3 s at 50 Mbit/s
(47.8 Mbit/s TCP goodput; gloo's all-to-all gets ~80% of it, see the probe): EP is ~7x its compute,
and HybridEP's own WAN time (expert gather, gradient return, the dense all-reduce every plan pays)
puts the expected top-point speedup at ~6x, the paper's regime with some margin for the 5x target;
at the lowest point (128 tokens) EP's WAN time is ~0.15 s next to ~0.1 s of compute. At 30 Mbit/s
the top speedup was ~10x (more WAN-bound than the paper), at 75 Mbit/s it would be ~5x.

The model (built in, or --model configs/models/X.yaml with num_layers == num_moe_layers): 2 MoE
layers, hidden 64, 8 GELU experts of ffn 64 (32 KB each in fp32), top-2, vocab 256. Like the paper,
experts are small next to the token traffic: a rank's experts (128 KB over both layers) are 4x-128x
below EP's token traffic per rank across the sweep.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from megatron_hybridep.bench.analysis import analyse
from megatron_hybridep.bench.config import (
    DEFAULTS,
    SMOKE,
    BenchConfig,
    BenchError,
    add_arguments,
    resolve,
)
from megatron_hybridep.bench.control import launch_controlled
from megatron_hybridep.bench.session import Progress, Session
from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.testbed.network import Testbed, TestbedConfig
from megatron_hybridep.testbed.sh import TestbedError
from megatron_hybridep.train.rank_imports import PRELOAD


def run_bench(cfg: BenchConfig, log: IO[str] = sys.stdout) -> dict[str, Any]:
    """Bring up the testbed, run calibration + measurement, analyse; returns the summary."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    spec = {"model": dataclasses.asdict(cfg.model), "seq": cfg.seq, "timeout_s": cfg.timeout,  # model: a ModelSpec
            "micro_batches": cfg.micro_batches, "hold_copies": cfg.hold_copies,
            "overlap_grad_reduce": cfg.overlap_grad_reduce}
    (cfg.out / "spec.json").write_text(json.dumps(spec, indent=1))
    repo = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="hybridep-bench-") as tmp, \
            Testbed(TestbedConfig(dcs=cfg.dcs, ranks_per_dc=cfg.ranks_per_dc, rate_mbit=cfg.rate_mbit,
                                  burst_ms=cfg.burst_ms or None, queue_ms=cfg.queue_ms,
                                  rto_min_ms=cfg.rto_min_ms or None,
                                  congestion=cfg.congestion)) as tb:
        session = Session(cfg, tb, log)
        session.say(f"{tb.describe()}; model {cfg.model.name}; points (tokens/rank) "
                    f"{[p['tokens'] for p in cfg.points]} x {cfg.micro_batches} micro-batches "
                    f"(borrowed copies: {cfg.borrowed_copies}; overlap-grad-reduce "
                    f"{'on' if cfg.overlap_grad_reduce else 'off'}); systems {','.join(cfg.systems)}")
        deadline = t0 + cfg.timeout
        launches: dict[int, int] = {}
        while session.pending():  # one launch per system run: fresh ranks (see bench/session)
            point = session.queue[0][0]
            launches[point] = launches.get(point, 0) + 1
            _launch(cfg, tb, session, env, Path(tmp), cfg.out / "logs" / f"point{point}" / f"run{launches[point]:02d}",
                    repo, Progress(t0, None if cfg.quiet else log), deadline)
    return analyse(cfg, session, session.events, time.monotonic() - t0)


def _launch(cfg: BenchConfig, tb: Testbed, session: Session, env: dict[str, str], tmp: Path, logs: Path,
            repo: Path, progress: Progress, deadline: float) -> None:
    """One set of rank workers, steered by `session` until rank 0 says bye."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise BenchError(f"the run exceeded its --timeout of {cfg.timeout:g} s")
    result = launch_controlled(tb, [sys.executable, "-m", "megatron_hybridep.bench.worker",
                                    "--spec", str(cfg.out / "spec.json")], session.handle,
                               str(tmp / "control.sock"), deadline, env=env, timeout_s=left, stream=progress,
                               log_dir=logs, cwd=repo, preload=PRELOAD)
    try:
        result.raise_for_status()
    except TestbedError as exc:
        raise BenchError(f"the rank workers failed (logs in {logs}):\n{exc}") from None


def run(args: argparse.Namespace) -> int:
    """Entry of `hybridep bench`: 0 on success (targets are reported, not enforced), 2 on errors."""
    try:
        if getattr(args, "reanalyse", None):
            from megatron_hybridep.bench.reanalyse import reanalyse

            reanalyse(Path(args.reanalyse))
            return 0
        cfg = resolve(args)
        run_bench(cfg)
    except (BenchError, TestbedError, PlanError) as exc:
        print(f"hybridep bench: error: {exc}", file=sys.stderr)
        return 2
    return 0


__all__ = ["BenchConfig", "BenchError", "DEFAULTS", "SMOKE", "add_arguments", "resolve", "run", "run_bench"]
