"""Options and configuration of `hybridep bench`: defaults, --smoke, the token sweep, and checks that
name the option and the fix."""

from __future__ import annotations

import argparse
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_hybridep.bench import predict as bp
from megatron_hybridep.bench.report import AUTO  # the report (a leaf module) holds the one definition
from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.model import ModelSpec
from megatron_hybridep.plan.workload import (
    EARLY_RETURN_RATIO,
    GRAD_VALUE_BYTES,
    QUALITY_GRAD_RATIO,
    QUALITY_WEIGHT_RATIO,
    auto_early_return,
)
from megatron_hybridep.testbed.network import CONGESTION_DEFAULT
from megatron_hybridep.testbed.sh import TestbedError
from megatron_hybridep.testbed.shaping import parse_rate_mbit

SYSTEMS = ("ep", "replicated", "hybridep", "hybridep-compressed", "pp", "auto", "auto-c")
COMPRESSED = "hybridep-compressed"  # HybridEP with weights and returned gradients top-k compressed
# pp: one pipeline stage per DC (PP = DCs), alltoall EP inside each DC: the layout Megatron's rank order
# gives a job launched DC by DC; auto: the layout planner's choice (plan/layout.py; TP 1 on CPU) among
# exact plans; auto-c: its choice when the user allows HybridEP-c's compression (what
# `--hybridep-layout auto --hybridep-compression-ratio R` plans), which it takes only where it pays.
# Layouts with PP run PP x the micro-batches per iteration: the same global batch on world / PP ranks.
LAYOUTS = ("pp", *AUTO)
PRICED_COMPRESSED = (COMPRESSED, "auto-c")  # systems planned and priced with the compression ratios
SPAN = 32  # token traffic range of the sweep (paper: 6..192 MB)
DEFAULTS: dict[str, Any] = {"dcs": 2, "ranks_per_dc": 2, "rate": "50mbit", "points": 6, "min_tokens": 128,
                            "seq": 128, "warmup": 2, "iters": 7, "systems": ",".join(SYSTEMS), "timeout": 1800.0,
                            "burst_ms": 1.0, "queue_ms": 0.0, "rto_min_ms": 0.0, "congestion": CONGESTION_DEFAULT,
                            "compression_ratio": QUALITY_WEIGHT_RATIO,
                            "grad_compression_ratio": QUALITY_GRAD_RATIO, "grad_values": "bf16",
                            "early_grad_return": "auto", "micro_batches": 1,
                            "borrowed_copies": "auto", "overlap_grad_reduce": True, "auto_trials": 2, "rounds": 1}
COPIES = ("auto", "iteration", "microbatch")  # --hybridep-borrowed-copies; auto = iteration (bench models fit)
# --smoke: the same path end to end, small enough for CI (< 60 s on 2 cores)
SMOKE: dict[str, Any] = {"points": 2, "min_tokens": 32, "seq": 32, "warmup": 1, "iters": 2, "timeout": 150.0,
                         "auto_trials": 1}


class BenchError(RuntimeError):
    """A bad option or a failed run; the message names the field and the fix."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `hybridep bench` options (None = the default, or the --smoke value)."""
    d = DEFAULTS
    parser.add_argument("--model", default=None,
                        help="model YAML (configs/models/*.yaml: num_layers == num_moe_layers, heads and vocab_size "
                             "stated); default: built-in "
                             f"{bp.BUILTIN.name} (2 layers, hidden 64, 8 experts of ffn 64, top-2)")
    parser.add_argument("--dcs", type=int, default=None, help=f"emulated DCs (default {d['dcs']})")
    parser.add_argument("--ranks-per-dc", type=int, default=None, help=f"ranks per DC (default {d['ranks_per_dc']})")
    parser.add_argument("--rate", default=None, help=f"WAN uplink rate of every DC (default {d['rate']})")
    parser.add_argument("--points", type=int, default=None, help=f"sweep points over a {SPAN}x token range "
                        f"(default {d['points']})")
    parser.add_argument("--min-tokens", type=int, default=None,
                        help=f"tokens per rank at the first point (default {d['min_tokens']})")
    parser.add_argument("--seq", type=int, default=None, help=f"sequence length; tokens = micro_batch x seq "
                        f"(default {d['seq']})")
    parser.add_argument("--warmup", type=int, default=None, help=f"warm-up iterations per run (default {d['warmup']})")
    parser.add_argument("--iters", type=int, default=None, help=f"timed iterations per run (default {d['iters']})")
    parser.add_argument("--systems", default=None, help=f"comma list of {','.join(SYSTEMS)} (default: all)")
    parser.add_argument("--out", default=None, help="output directory (default runs/bench-<time>)")
    parser.add_argument("--timeout", type=float, default=None, help=f"limit for the whole run in s "
                        f"(default {d['timeout']:g})")
    parser.add_argument("--burst-ms", type=float, default=None,
                        help="HTB bucket of each uplink as time at the rate (TestbedConfig.burst_ms; default "
                             "1 ms, like a real link that banks no idle time; 0 keeps the testbed's >= 70 KB)")
    parser.add_argument("--queue-ms", type=float, default=None,
                        help="queue before each uplink's rate limit as ms at the rate (TestbedConfig.queue_ms), e.g. "
                             "50: a shallow-buffer link; default 0: the kernel's 1000 packets")
    parser.add_argument("--rto-min-ms", type=float, default=None,
                        help="TCP's minimum retransmission timeout inside the DCs (TestbedConfig.rto_min_ms; needs "
                             "Linux >= 6.11); default 0: the kernel's 200 ms (docs/testbed.md, \"Queue and TCP\")")
    parser.add_argument("--congestion", default=None,
                        help=f"TCP congestion control inside the DCs (TestbedConfig.congestion; default "
                             f"{d['congestion']}); host: the host's default, which the runs recorded before 2026-11-27 "
                             "had (BBR here)")
    parser.add_argument("--compression-ratio", type=float, default=None,
                        help=f"{COMPRESSED} and auto-c: element ratio of the shipped expert weights "
                             f"(shared + top-k residual) (default {d['compression_ratio']:g}, the runtime's "
                             "quality cap; docs/results.md's runs from before that cap used 50)")
    parser.add_argument("--grad-compression-ratio", type=float, default=None,
                        help=f"{COMPRESSED} and auto-c: element ratio of the returned gradients (top-k, error "
                             "feedback); "
                             f"default {d['grad_compression_ratio']:g}, the runtime's quality cap "
                             "(docs/compression.md)")
    parser.add_argument("--grad-compression-values", choices=tuple(GRAD_VALUE_BYTES), default=None,
                        help=f"{COMPRESSED} and auto-c: the returned gradients' kept values in bf16 (default, the "
                             "runtime's) or in the gradient's fp32 (the runs recorded before 2026-11-26's change)")
    parser.add_argument("--early-grad-return", type=float, default=None, metavar="R",
                        help=f"{COMPRESSED} and auto-c: pretrain_moe.py's --hybridep-early-grad-return R (the first "
                             "M-1 micro-batches' returned gradients leave during the last, the rest at ratio R; "
                             f"default: pretrain_moe.py's auto, {EARLY_RETURN_RATIO:g} for returned gradients at most "
                             f"{QUALITY_GRAD_RATIO:g}x with copies held; 0 = off)")
    parser.add_argument("--micro-batches", type=int, default=None,
                        help="micro-batches per iteration at every point, each of the point's micro_batch x seq "
                             "tokens, through Megatron's schedule (gradients reduced once per iteration; default 1)")
    parser.add_argument("--borrowed-copies", choices=COPIES, default=None,
                        help="HybridEP's borrowed expert copies: held for the iteration (one gather and one "
                             "gradient return per iteration) or re-gathered per micro-batch; auto = iteration")
    parser.add_argument("--overlap-grad-reduce", action=argparse.BooleanOptionalAction, default=None,
                        help="Megatron's --overlap-grad-reduce in every system, as a Megatron user runs it "
                             "(default on; --no-overlap-grad-reduce: the blocking reduction)")
    parser.add_argument("--auto-trials", type=int, default=None,
                        help="auto and auto-c: of the planner's finalists that no measured system stands for, how "
                             "many compete per point (the planner's fastest; default "
                             f"{d['auto_trials']}; 0: only the measured ones); every finalist runs two unshaped "
                             "trials, back to back with the others' (A B .. B A; bench/finalists.py)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="measure every system this many times per point, the systems interleaved (later rounds "
                             "in reversed, then the first order; auto keeps its first round's layout): rows pool "
                             f"the rounds' iterations (default {d['rounds']})")
    parser.add_argument("--smoke", action="store_true",
                        help=f"quick end-to-end check: {SMOKE['points']} points from {SMOKE['min_tokens']} tokens, "
                             f"seq {SMOKE['seq']}, {SMOKE['warmup']} warm-up + {SMOKE['iters']} iterations")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--reanalyse", metavar="DIR",
                        help="no testbed: redo the analysis of the finished run in DIR (its --out) from its logs, "
                             "with today's cost model; rewrites its report, CSV, PNG and summary")


# ---- configuration ---------------------------------------------------------------------------------
@dataclass
class BenchConfig:
    model: ModelSpec
    model_source: str
    dcs: int
    ranks_per_dc: int
    rate_mbit: float
    rate_text: str
    points: list[dict[str, int]]
    seq: int
    min_tokens: int
    warmup: int
    iters: int
    systems: list[str]
    out: Path
    timeout: float
    smoke: bool
    burst_ms: float
    compression_ratio: float = DEFAULTS["compression_ratio"]
    grad_compression_ratio: float = DEFAULTS["grad_compression_ratio"]
    quiet: bool = False
    micro_batches: int = 1
    borrowed_copies: str = "auto"
    overlap_grad_reduce: bool = True
    queue_ms: float = DEFAULTS["queue_ms"]  # 0: the kernel's 1000-packet queue
    rto_min_ms: float = DEFAULTS["rto_min_ms"]  # 0: the kernel's 200 ms
    congestion: str = DEFAULTS["congestion"]  # "host": the host's default (runs before 2026-11-27)
    grad_values: str = DEFAULTS["grad_values"]  # the returned gradients' kept values: bf16 or "same" (fp32 here)
    early_grad_return: float = DEFAULTS["early_grad_return"]  # --hybridep-early-grad-return's rest ratio (0: off)
    auto_trials: int = DEFAULTS["auto_trials"]  # unshaped trials of auto's finalists per point (bench/finalists.py)
    rounds: int = DEFAULTS["rounds"]  # every system measured this many times per point, interleaved
    cores: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))  # the cores the ranks share

    def system_micro_batches(self, system: str, pp: int = 1) -> int:
        """Micro-batches per iteration of a system whose layout has ``pp`` stages: the same global batch."""
        return self.micro_batches * (self.dcs if system == "pp" else pp)

    @property
    def hold_copies(self) -> bool:
        return self.borrowed_copies != "microbatch"

    @property
    def world(self) -> int:
        return self.dcs * self.ranks_per_dc

    def command(self) -> str:
        """The exact command that reproduces this run (every option spelled out)."""
        argv = ["python", "-m", "megatron_hybridep", "bench"]
        if self.model_source != "builtin":
            argv += ["--model", self.model_source]
        argv += ["--dcs", str(self.dcs), "--ranks-per-dc", str(self.ranks_per_dc), "--rate", self.rate_text,
                 "--points", str(len(self.points)), "--min-tokens", str(self.min_tokens), "--seq", str(self.seq),
                 "--warmup", str(self.warmup), "--iters", str(self.iters), "--systems", ",".join(self.systems),
                 "--burst-ms", f"{self.burst_ms:g}", "--congestion", self.congestion]
        if self.queue_ms:
            argv += ["--queue-ms", f"{self.queue_ms:g}"]
        if self.rto_min_ms:
            argv += ["--rto-min-ms", f"{self.rto_min_ms:g}"]
        if any(s in self.systems for s in PRICED_COMPRESSED):
            argv += ["--compression-ratio", f"{self.compression_ratio:g}",
                     "--grad-compression-ratio", f"{self.grad_compression_ratio:g}",
                     "--grad-compression-values", self.grad_values,
                     "--early-grad-return", f"{self.early_grad_return:g}"]
        argv += ["--micro-batches", str(self.micro_batches)]
        if self.borrowed_copies != "auto":
            argv += ["--borrowed-copies", self.borrowed_copies]
        if not self.overlap_grad_reduce:
            argv += ["--no-overlap-grad-reduce"]
        if any(s in self.systems for s in AUTO):
            argv += ["--auto-trials", str(self.auto_trials)]
        if self.rounds != 1:
            argv += ["--rounds", str(self.rounds)]
        argv += ["--out", str(self.out)]
        return shlex.join(argv)


def sweep(min_tokens: int, seq: int, points: int) -> list[dict[str, int]]:
    """Tokens per rank from min_tokens over a SPAN-fold range, geometric, as micro_batch x seq."""
    out = []
    for i in range(points):
        tokens = min_tokens * SPAN ** (i / (points - 1))
        mbs = max(1, round(tokens / seq))
        out.append({"index": i, "micro_batch": mbs, "seq": seq, "tokens": mbs * seq})
    return out


def resolve(args: argparse.Namespace) -> BenchConfig:
    def get(name: str) -> Any:
        value = getattr(args, name, None)
        if value is not None:
            return value
        return SMOKE[name] if args.smoke and name in SMOKE else DEFAULTS[name]

    systems = [s.strip() for s in get("systems").split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        raise BenchError(f"--systems: unknown {bad or 'empty list'}; fix: a comma list of {','.join(SYSTEMS)}")
    if "ep" not in systems:
        raise BenchError("--systems: speedups are relative to alltoall EP; fix: keep 'ep' in the list")
    dcs, k = get("dcs"), get("ranks_per_dc")
    if dcs < 2:
        raise BenchError(f"--dcs: need at least 2 DCs to have a WAN, got {dcs}; fix: --dcs 2")
    if k < 1:
        raise BenchError(f"--ranks-per-dc: must be >= 1, got {k}; fix: --ranks-per-dc 2")
    if "replicated" in systems and k < 2:
        raise BenchError("--systems replicated needs --ranks-per-dc >= 2 (EP inside each DC); fix: raise "
                         "--ranks-per-dc or drop replicated from --systems")
    points, seq, min_tokens = get("points"), get("seq"), get("min_tokens")
    if points < 2:
        raise BenchError(f"--points: need at least 2 to span a range, got {points}; fix: --points 6")
    if seq < 2 or min_tokens < seq or min_tokens % seq:
        raise BenchError(f"--min-tokens/--seq: tokens per rank are micro_batch x seq, so --min-tokens ({min_tokens}) "
                         f"must be a positive multiple of --seq ({seq}); fix: e.g. --min-tokens {max(seq, 2) * 4}")
    warmup, iters = get("warmup"), get("iters")
    if warmup < 0 or iters < 1:
        raise BenchError(f"--warmup/--iters: need warmup >= 0 and iters >= 1, got {warmup}/{iters}; "
                         "fix: e.g. --warmup 2 --iters 7")
    rate_text = str(get("rate"))
    try:
        rate = parse_rate_mbit(rate_text)
    except TestbedError as exc:
        raise BenchError(f"--rate: {exc}; fix: e.g. --rate 40mbit") from None
    if rate is None:
        raise BenchError("--rate: the benchmark needs a shaped WAN; fix: e.g. --rate 40mbit")
    model_path = args.model
    try:
        model = bp.load_model(model_path) if model_path else bp.BUILTIN
        bp.check_model(model, dcs * k)
    except PlanError as exc:
        raise BenchError(f"--model: {exc}") from None
    if "pp" in systems and (model.num_layers % dcs or model.num_experts % k):
        raise BenchError(f"--systems pp: one pipeline stage per DC needs the layers ({model.num_layers}) divisible by "
                         f"--dcs ({dcs}) and the experts ({model.num_experts}) by --ranks-per-dc ({k}); fix: a "
                         "deeper --model, or drop pp from --systems")
    burst_ms = float(get("burst_ms"))
    if burst_ms < 0:
        raise BenchError(f"--burst-ms: must be >= 0, got {burst_ms}; fix: 1 (a real link) or 0 (the testbed's)")
    queue_ms = float(get("queue_ms"))
    rto_min_ms = float(get("rto_min_ms"))
    if rto_min_ms < 0:
        raise BenchError(f"--rto-min-ms: must be >= 0, got {rto_min_ms:g}; fix: e.g. 2000, or 0 (the kernel's 200 ms)")
    if queue_ms < 0:
        raise BenchError(f"--queue-ms: must be >= 0, got {queue_ms:g}; fix: e.g. 50, or 0 (the kernel's 1000 "
                         "packets)")
    ratio = float(get("compression_ratio"))
    if not ratio > 1:
        raise BenchError(f"--compression-ratio: must be > 1 for {COMPRESSED}, got {ratio:g}; fix: e.g. "
                         f"{QUALITY_WEIGHT_RATIO:g}, or drop "
                         f"{COMPRESSED} from --systems")
    grad_ratio = float(get("grad_compression_ratio"))
    if not grad_ratio >= 1:
        raise BenchError(f"--grad-compression-ratio: must be >= 1 (1 = exact gradients), got {grad_ratio:g}; "
                         f"fix: e.g. {QUALITY_GRAD_RATIO:g}")
    micro = int(get("micro_batches"))
    if micro < 1:
        raise BenchError(f"--micro-batches: must be >= 1, got {micro}; fix: e.g. --micro-batches 4")
    early = get("early_grad_return")
    early = (auto_early_return(grad_ratio) if get("borrowed_copies") != "microbatch" else 0.0) \
        if early == "auto" else float(early)
    if early and not (early >= 1 and grad_ratio > 1 and get("borrowed_copies") != "microbatch"):
        raise BenchError(f"--early-grad-return: {early:g} needs a ratio >= 1, compressed returned gradients "
                         "(--grad-compression-ratio > 1) and copies held for the iteration; fix: e.g. "
                         "--early-grad-return 16 with --grad-compression-ratio 4, or drop it")
    trials = int(get("auto_trials"))
    if trials < 0:
        raise BenchError(f"--auto-trials: must be >= 0, got {trials}; fix: e.g. --auto-trials 2")
    rounds = int(get("rounds"))
    if rounds < 1:
        raise BenchError(f"--rounds: must be >= 1, got {rounds}; fix: e.g. --rounds 2")
    out = Path(args.out) if args.out else Path("runs") / time.strftime("bench-%Y%m%d-%H%M%S")
    return BenchConfig(model, model_path or "builtin", dcs, k, rate, rate_text, sweep(min_tokens, seq, points), seq,
                       min_tokens, warmup, iters, systems, out, float(get("timeout")), bool(args.smoke), burst_ms,
                       ratio, grad_ratio, bool(getattr(args, "quiet", False)), micro, str(get("borrowed_copies")),
                       bool(get("overlap_grad_reduce")), queue_ms=queue_ms, rto_min_ms=rto_min_ms,
                       congestion=str(get("congestion")), grad_values=str(get("grad_values")), auto_trials=trials,
                       rounds=rounds, early_grad_return=early)
