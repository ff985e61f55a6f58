"""`hybridep bench`: HybridEP against Megatron's alltoall EP and the replicated-experts plan, training
the real Megatron GPT-MoE on the emulated multi-DC testbed (network namespaces + tc; needs root).

    python -m megatron_hybridep bench                      # defaults below, ~5 min on 2 cores
    python -m megatron_hybridep bench --smoke              # 2 points, tiny batches, < 60 s
    python -m megatron_hybridep bench --rate 100mbit --points 4 --min-tokens 256 --out runs/b1

One testbed (D DCs x K ranks), one launch of the rank workers (bench_worker), steered by the parent
over a control socket (bench_control). Point by point, highest traffic first (tokens per rank =
micro_batch x seq, --points values over a 32x range, so the token traffic per rank spans 32x like the
paper's 6..192 MB), system by system (EP first, then replicated, then HybridEP):
1. WAN unshaped: build the system, warm up, K iterations -> the unshaped step time the prediction
   starts from, and (EP) the compute the cost model is fed: T_pre and the expert speed;
2. HybridEP's plan is the planner's (plan/planner.py, its own cost model) for a Topology of the
   testbed (bandwidth = TCP goodput of the rate) and a Workload of the model, tokens and step 1;
3. WAN shaped to --rate: warm up, K timed iterations; the uplink byte counters over exactly the
   timed window; the prediction (bench_predict) next to it.
Measuring each system unshaped and shaped back to back keeps the machine's load (shared cores)
out of the comparison as far as possible; the report states the load average of every point.

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
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.testbed import bench_predict as bp
from megatron_hybridep.testbed import bench_report as br
from megatron_hybridep.testbed.bench_control import CONTROL_ENV, ControlServer
from megatron_hybridep.testbed.network import Testbed, TestbedConfig
from megatron_hybridep.testbed.selfcheck import TCP_GOODPUT_FRACTION, measure_throughput
from megatron_hybridep.testbed.sh import TestbedError, sh
from megatron_hybridep.testbed.shaping import parse_rate_mbit

SYSTEMS = ("ep", "replicated", "hybridep")
SPAN = 32  # token traffic range of the sweep (paper: 6..192 MB)
DEFAULTS: dict[str, Any] = {"dcs": 2, "ranks_per_dc": 2, "rate": "50mbit", "points": 6, "min_tokens": 128,
                            "seq": 128, "warmup": 2, "iters": 7, "systems": ",".join(SYSTEMS), "timeout": 1800.0,
                            "burst_ms": 1.0}
# --smoke: the same path end to end, small enough for CI (< 60 s on 2 cores)
SMOKE: dict[str, Any] = {"points": 2, "min_tokens": 32, "seq": 32, "warmup": 1, "iters": 2, "timeout": 150.0}
PROBE_S = 0.4  # seconds per bandwidth probe (unshaped cross-DC and intra-DC)
PROBE_REPEATS = 3  # bare all-to-alls on the shaped WAN


class BenchError(RuntimeError):
    """A bad option or a failed run; the message names the field and the fix."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `hybridep bench` options (None = the default, or the --smoke value)."""
    d = DEFAULTS
    parser.add_argument("--model", default=None,
                        help="model YAML (configs/models/*.yaml, num_layers == num_moe_layers); default: built-in "
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
                        help="HTB bucket of each uplink as time at the rate (default 1 ms, like a real link that banks "
                             "no idle time; 0 keeps the testbed's >= 70 KB)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"quick end-to-end check: {SMOKE['points']} points from {SMOKE['min_tokens']} tokens, "
                             f"seq {SMOKE['seq']}, {SMOKE['warmup']} warm-up + {SMOKE['iters']} iterations")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


# ---- configuration ---------------------------------------------------------------------------------
@dataclass
class BenchConfig:
    model: bp.ModelShape
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
    quiet: bool = False

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
                 "--burst-ms", f"{self.burst_ms:g}", "--out", str(self.out)]
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
        model.check(dcs * k)
    except PlanError as exc:
        raise BenchError(f"--model: {exc}") from None
    burst_ms = float(get("burst_ms"))
    if burst_ms < 0:
        raise BenchError(f"--burst-ms: must be >= 0, got {burst_ms}; fix: 1 (a real link) or 0 (the testbed's)")
    out = Path(args.out) if args.out else Path("runs") / time.strftime("bench-%Y%m%d-%H%M%S")
    return BenchConfig(model, model_path or "builtin", dcs, k, rate, rate_text, sweep(min_tokens, seq, points), seq,
                       min_tokens, warmup, iters, systems, out, float(get("timeout")), bool(args.smoke), burst_ms,
                       bool(getattr(args, "quiet", False)))


# ---- the run ---------------------------------------------------------------------------------------
class Progress:
    """Stream for the launcher: prints one line per finished point (rank 0's events), drops the rest
    (every rank's full output is in <out>/logs)."""

    def __init__(self, t0: float, sink: IO[str] | None) -> None:
        self.t0, self.sink = t0, sink

    def write(self, text: str) -> None:
        if self.sink is None or not text.startswith("[r0 ") or '"event": "point"' not in text:
            return
        e = json.loads(text.split("BENCH ", 1)[1])
        self.sink.write(f"[{time.monotonic() - self.t0:6.0f}s] {e['phase']:<9} {e['system']:<10} {e['plan']:<17} "
                        f"{e['tokens']:>6} tokens: median {e['median_s'] * 1e3:8.1f} ms\n")
        self.sink.flush()

    def flush(self) -> None:
        pass


@dataclass
class Session:
    """The parent's side of the control protocol. Point by point, system by system: build and
    calibrate with the WAN unshaped, then shape it and measure (HybridEP: the planner's plan)."""

    cfg: BenchConfig
    tb: Testbed
    log: IO[str]
    queue: list[tuple[int, str]] = field(default_factory=list)
    current: tuple[int, str] | None = None
    shaped: bool = True
    candidates: list[Plan] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # rank 0's, from the control requests
    chosen: dict[int, Plan] = field(default_factory=dict)  # HybridEP's plan per point
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # highest traffic first: its comparison matters most, and on a shared machine the first
        # minutes are the ones most likely to see the load the run started with
        self.queue = [(p["index"], s) for p in reversed(self.cfg.points) for s in SYSTEMS if s in self.cfg.systems]
        self.info.update(chosen={}, planner_best={}, shaped_tx_bytes=0.0)

    def say(self, msg: str) -> None:
        if not self.cfg.quiet:
            self.log.write(msg + "\n")
            self.log.flush()

    def set_shaped(self, shaped: bool) -> None:
        if shaped == self.shaped:
            return
        now = self.tb.link_counters()
        if shaped:
            self.info["_counters"] = now
        elif (before := self.info.pop("_counters", None)) is not None:  # a shaped segment ended: its bytes (tx)
            self.info["shaped_tx_bytes"] += sum(b.tx_bytes - a.tx_bytes for a, b in zip(before, now, strict=True))
        for dc in range(self.tb.dcs):
            self.tb.set_rate(dc, self.cfg.rate_mbit if shaped else None)
            if shaped and self.cfg.burst_ms > 0:
                tighten_burst(self.tb, dc, self.cfg.rate_mbit, self.cfg.burst_ms)
        self.shaped = shaped

    def probe(self) -> None:
        """Unshaped cross-DC and intra-DC bandwidth (the unshaped Topology) and the candidate plans."""
        self.set_shaped(False)
        self.info["unshaped_wan_mbit"] = measure_throughput(self.tb, 0, 1, seconds=PROBE_S).mbit
        self.info["intra_mbit"] = measure_throughput(self.tb, 0, 0, seconds=PROBE_S).mbit
        self.candidates = bp.candidate_plans(self.topology(shaped=True), self.cfg.model.num_experts)
        self.say(f"WAN unshaped {self.info['unshaped_wan_mbit']:.0f} Mbit/s, intra-DC {self.info['intra_mbit']:.0f} "
                 f"Mbit/s (measured); shaped: {self.cfg.rate_text} per DC uplink; HybridEP candidates: "
                 + ", ".join(p.label for p in self.candidates))

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        self.events += request.get("events", [])
        if op == "next":
            if not self.candidates:
                self.probe()
                self.set_shaped(True)
                m = self.cfg.model  # EP's all-to-all of each point, bytes per rank
                sizes = [p["tokens"] * m.topk * m.hidden_size * bp.FP32 for p in self.cfg.points]
                return {"probe": {"sizes": sizes, "repeats": PROBE_REPEATS}}
            self.set_shaped(False)
            if not self.queue:
                return {"done": True}
            self.current = self.queue.pop(0)
            point, system = self.current
            order: dict[str, Any] = {"system": system, "point": self.cfg.points[point],
                                     "warmup": self.cfg.warmup, "iters": self.cfg.iters}
            if system == "hybridep":  # EP ran first at this point: its calibration feeds the planner
                order["plans"] = [self.choose_plan(point).to_dict()]
            return order
        if op == "shape":
            assert self.current is not None
            self.set_shaped(True)
            return {"measure": [0] if self.current[1] == "hybridep" else [None]}
        raise BenchError(f"control: unknown request {request!r} from the rank 0 worker")

    def topology(self, shaped: bool) -> Any:
        wan = self.cfg.rate_mbit * TCP_GOODPUT_FRACTION if shaped else self.info["unshaped_wan_mbit"]
        return bp.testbed_topology(self.cfg.dcs, self.cfg.ranks_per_dc, wan, self.info["intra_mbit"])

    def workload(self, point: dict[str, int], events: list[dict[str, Any]]) -> Any:
        """Workload of a point, fed with EP's unshaped compute timings (per step, all layers)."""
        e = next(e for e in events if e["event"] == "point" and e["phase"] == "calibrate" and e["system"] == "ep"
                 and e["point"] == point["index"])
        r = e["ranks"]
        calib = bp.Calibration(r["t_pre"], r["expert_fwd"], r["expert_rows"])
        return calib.workload(self.cfg.model, point["tokens"], point["seq"])

    def choose_plan(self, point: int) -> Plan:
        """The planner's HybridEP plan for this point, from EP's calibration of it."""
        result = bp.plan_for_point(self.topology(shaped=True), self.workload(self.cfg.points[point], self.events),
                                   self.cfg.world)
        plan = bp.best_domains_plan(result)
        self.chosen[point] = plan
        self.info["chosen"][point], self.info["planner_best"][point] = plan.label, result.best.label
        return plan


def tighten_burst(tb: Testbed, dc: int, mbit: float, burst_ms: float) -> None:
    """Shrink the HTB bucket of DC dc's uplink (both ends) to burst_ms at the rate (>= 2 frames).

    The testbed's bucket holds >= 70 KB (14 ms at 40 Mbit/s): after every idle gap (compute) the next
    collective's first 70 KB pass at veth speed, so the small all-to-alls of the low points ran almost
    unshaped. A real WAN link banks no idle time. The testbed has no burst setting (reported), so this
    changes its HTB class in place after each set_rate()."""
    burst = max(int(mbit * 1e6 / 8 * burst_ms / 1e3), 2 * 1514)
    rate = f"{round(mbit * 1000)}kbit"
    for ns, dev in tb._ends(dc):  # noqa: SLF001 - see the docstring
        sh(["tc", "-n", ns, "class", "change", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate,
            "ceil", rate, "burst", str(burst), "cburst", str(burst), "quantum", "1514"])


def run_bench(cfg: BenchConfig, log: IO[str] = sys.stdout) -> dict[str, Any]:
    """Bring up the testbed, run calibration + measurement, analyse; returns the summary."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    spec = {"model": cfg.model.gpt_args(cfg.seq), "timeout_s": cfg.timeout}
    (cfg.out / "spec.json").write_text(json.dumps(spec, indent=1))
    repo = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="hybridep-bench-") as tmp, \
            Testbed(TestbedConfig(dcs=cfg.dcs, ranks_per_dc=cfg.ranks_per_dc, rate_mbit=cfg.rate_mbit)) as tb:
        session = Session(cfg, tb, log)
        session.say(f"{tb.describe()}; model {cfg.model.name}; points (tokens/rank) "
                    f"{[p['tokens'] for p in cfg.points]}; systems {','.join(cfg.systems)}")
        control = ControlServer(os.path.join(tmp, "control.sock"))
        env[CONTROL_ENV] = control.path
        try:
            group = tb.start([sys.executable, "-m", "megatron_hybridep.testbed.bench_worker",
                              "--spec", str(cfg.out / "spec.json")], env=env, timeout_s=cfg.timeout,
                             stream=Progress(t0, None if cfg.quiet else log), log_dir=cfg.out / "logs", cwd=repo)
            with group:
                control.serve(group.pids, session.handle, time.monotonic() + cfg.timeout)
                result = group.wait()
        finally:
            control.close()
        try:
            result.raise_for_status()
        except TestbedError as exc:
            raise BenchError(f"the rank workers failed (logs in {cfg.out / 'logs'}):\n{exc}") from None
    return analyse(cfg, session, session.events, time.monotonic() - t0)


def analyse(cfg: BenchConfig, session: Session, events: list[dict[str, Any]], elapsed_s: float) -> dict[str, Any]:
    measured = [e for e in events if e["event"] == "point" and e["phase"] == "measure"]
    calib = {(e["system"], e["plan"], e["point"]): e for e in events
             if e["event"] == "point" and e["phase"] == "calibrate"}
    dense = next(e["dense_params"] for e in events if e["event"] == "model")
    shaped, unshaped = session.topology(shaped=True), session.topology(shaped=False)
    ep_median = {e["point"]: e["median_s"] for e in measured if e["system"] == "ep"}
    probes = probe_summary(cfg, events)
    rows: list[br.Row] = []
    for e in sorted(measured, key=lambda e: (e["point"], SYSTEMS.index(e["system"]))):
        point = cfg.points[e["point"]]
        workload = session.workload(point, events)
        if e["system"] == "hybridep":
            plan = session.chosen[e["point"]]
        else:
            plan = bp.system_plan(e["system"], shaped, cfg.model.num_experts)
        base = calib[(e["system"], e["plan"], e["point"])]
        window = base["ranks"]["expert_gather_wall_s"] / cfg.model.num_layers if plan.domain_size > 1 else None
        pred = bp.predict(shaped, unshaped, workload, plan, dense, base["median_s"], window)
        eff = probes.get(e["point"], {}).get("efficiency", 1.0)
        rows.append(make_row(cfg, e, base, pred, ep_median[e["point"]], eff))
    checks = br.check_targets(rows)
    write_outputs(cfg, rows, checks, session, elapsed_s)
    return {"rows": rows, "checks": checks, "elapsed_s": elapsed_s}


def make_row(cfg: BenchConfig, e: dict[str, Any], base: dict[str, Any], pred: bp.Prediction,
             ep_median: float, a2a_efficiency: float) -> br.Row:
    steps, r, b = e["step_s"], e["ranks"], base["ranks"]
    q1, q3 = br.quartiles(steps)
    link = e["link"]
    n, it = len(link), e["iters"]
    a2a_fwd = r["token_dispatch_s"] + r["token_combine_s"]
    # the token all-to-alls at the rate the probe saw a bare all-to-all of this size get
    probed = pred.total + pred.phases["token_a2a"] * (1 / a2a_efficiency - 1)
    payload = sum(r[f"{p}_dc_bytes"] for p in ("token_dispatch", "token_combine", "expert_gather", "grad_return"))
    payload += r["token_dispatch_dc_bytes"] + r["token_combine_dc_bytes"]  # backward: the transposes
    return br.Row(
        point=e["point"], tokens=e["tokens"], micro_batch=e["micro_batch"], seq=e["seq"],
        token_traffic_mb=cfg.model.token_traffic_bytes(e["tokens"]) / 1e6, system=e["system"], plan=e["plan"],
        iters=it, median_s=e["median_s"], min_s=min(steps), max_s=max(steps), q1_s=q1, q3_s=q3,
        speedup_vs_ep=ep_median / e["median_s"], unshaped_s=base["median_s"], predicted_s=pred.total,
        pred_error_pct=(pred.total / e["median_s"] - 1) * 100, planner_s=pred.planner_total,
        a2a_efficiency=a2a_efficiency, pred_probe_s=probed,
        pred_probe_error_pct=(probed / e["median_s"] - 1) * 100,
        pred_token_a2a_s=pred.phases["token_a2a"], pred_expert_gather_s=pred.phases["expert_gather"],
        pred_grad_return_s=pred.phases["grad_return"],
        pred_expert_grad_allreduce_s=pred.phases["expert_grad_allreduce"],
        pred_dense_grad_allreduce_s=pred.phases["dense_grad_allreduce"],
        meas_a2a_fwd_s=a2a_fwd,
        pred_a2a_fwd_s=b["token_dispatch_s"] + b["token_combine_s"] + pred.phases["token_a2a"] / 2,
        meas_gather_wait_s=r["expert_gather_s"], pred_gather_wait_s=b["expert_gather_s"] + pred.phases["expert_gather"],
        meas_grad_return_s=r["grad_return_s"], pred_grad_return_full_s=b["grad_return_s"] + pred.phases["grad_return"],
        meas_grad_sync_s=r["grad_sync"],
        pred_grad_sync_s=b["grad_sync"] + pred.phases["expert_grad_allreduce"] + pred.phases["dense_grad_allreduce"],
        wan_tx_mb=sum(c["tx_bytes"] for c in link) / n / it / 1e6,
        wan_rx_mb=sum(c["rx_bytes"] for c in link) / n / it / 1e6,
        pred_wan_mb=pred.dc_uplink_bytes / TCP_GOODPUT_FRACTION / 1e6,
        payload_dc_mb=payload / 1e6, loadavg=sum(e["loadavg"]) / 2)


def probe_summary(cfg: BenchConfig, events: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per point, the bare all-to-all probe against the configured rate (its wire bytes / rate)."""
    out = {}
    for e in events:
        if e["event"] != "probe" or not e["link"]:
            continue
        wire = sum(c["tx_bytes"] for c in e["link"]) / len(e["link"]) / e["repeats"]
        ideal = wire / (cfg.rate_mbit * 1e6 / 8)
        out[e["point"]] = {"bytes_per_rank": e["bytes_per_rank"], "median_s": e["median_s"], "wan_mb": wire / 1e6,
                           "ideal_s": ideal, "efficiency": ideal / e["median_s"]}
    return out


def format_probe(cfg: BenchConfig, probes: dict[int, dict[str, float]]) -> str:
    if not probes:
        return "all-to-all probe: none"
    parts = [f"{cfg.points[p]['tokens']}: {v['median_s'] * 1e3:.0f}/{v['ideal_s'] * 1e3:.0f} ms = {v['efficiency']:.0%}"
             for p, v in sorted(probes.items())]
    return ("bare gloo all-to-all of each point's EP size on the shaped WAN (measured / its wire bytes at the rate = "
            "share of the rate it gets): " + ", ".join(parts))


def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, Linux {platform.release()}, torch CPU + gloo"


def write_outputs(cfg: BenchConfig, rows: list[br.Row], checks: list[br.TargetCheck], session: Session,
                  elapsed_s: float) -> None:
    csv_path, png_path = cfg.out / "bench.csv", cfg.out / "bench.png"
    br.write_csv(rows, csv_path)
    title = (f"HybridEP vs alltoall EP vs replicated: {cfg.dcs} DCs x {cfg.ranks_per_dc} ranks, WAN {cfg.rate_text} "
             f"per DC, model {cfg.model.name}, {cfg.iters} iterations per point")
    br.plot(rows, png_path, title)
    probe = probe_summary(cfg, session.events)
    window = sum(r.wan_tx_mb * r.iters for r in rows)
    total = session.info["shaped_tx_bytes"] / cfg.dcs / 1e6
    summary = {
        "command": cfg.command(), "machine": machine(), "rate_mbit": cfg.rate_mbit,
        "goodput_mbit": cfg.rate_mbit * TCP_GOODPUT_FRACTION, "model": cfg.model.__dict__,
        "points": cfg.points, "elapsed_s": elapsed_s, "probe": {k: session.info[k] for k in
                                                                ("unshaped_wan_mbit", "intra_mbit")},
        "hybridep_plans": session.info["chosen"], "planner_best_overall": session.info["planner_best"],
        "targets": [c.__dict__ for c in checks],
        "link_counters_check_mb": {"timed_windows": window, "shaped_segments": total},
        "all_to_all_probe": probe,
    }
    (cfg.out / "summary.json").write_text(json.dumps(summary, indent=1))
    text = [
        f"machine: {summary['machine']}",
        f"testbed: {cfg.dcs} DCs x {cfg.ranks_per_dc} ranks, WAN {cfg.rate_text} per DC uplink "
        f"(TCP goodput {summary['goodput_mbit']:.1f} Mbit/s), model {cfg.model.name}, "
        f"{cfg.warmup} warm-up + {cfg.iters} timed iterations",
        "", br.format_table(rows),
        "median of the timed iterations [min-max]; pred = cost-model prediction (WAN at the TCP goodput of the "
        "rate), err = (pred - measured) / measured; probe = the error with the token all-to-alls at the share of the "
        "rate a bare all-to-all of the same size got (below); load = the machine's 1-minute load average around the "
        f"timed window ({os.cpu_count()} cores: above that, other jobs competed for them)", "",
        "per phase, ms per iteration (measured / predicted; a2a = forward dispatch + combine, the backward's "
        "transposes are not timed separately):",
        br.format_phases(rows), "",
        "planner's overall best per point (its own cost model, replicated included): "
        + ", ".join(f"{cfg.points[p]['tokens']}: {b}" for p, b in sorted(session.info["planner_best"].items())),
        format_probe(cfg, probe),
        f"link counters: the timed windows hold {window:.1f} MB of the {total:.1f} MB per DC uplink (tx) sent while "
        "the WAN was shaped (the rest: warm-up)",
        "targets:", br.format_targets(checks), "",
        f"wrote {csv_path}, {png_path}, {cfg.out / 'summary.json'}; {elapsed_s:.0f} s",
        f"command: {cfg.command()}",
    ]
    (cfg.out / "report.txt").write_text("\n".join(text) + "\n")
    print("\n".join(text))


def run(args: argparse.Namespace) -> int:
    """Entry of `hybridep bench`: 0 on success (targets are reported, not enforced), 2 on errors."""
    try:
        cfg = resolve(args)
        run_bench(cfg)
    except (BenchError, TestbedError, PlanError) as exc:
        print(f"hybridep bench: error: {exc}", file=sys.stderr)
        return 2
    return 0


__all__ = ["BenchConfig", "BenchError", "DEFAULTS", "SMOKE", "add_arguments", "resolve", "run", "run_bench"]
