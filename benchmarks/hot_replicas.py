#!/usr/bin/env python
"""Skew-aware plans on the emulated testbed (root): measured step time of the planner's hot-replica
plan vs every equal-size-domain plan and Megatron's alltoall EP, under synthetic skewed routing.

    sudo python benchmarks/hot_replicas.py --rate 50mbit --tokens 1024 --repeats 3

2 DCs x 2 ranks (testbed/, WAN shaped to --rate per DC uplink with a 1 ms HTB bucket as `hybridep
bench` does). The GPT-MoE of `hybridep bench` (2 layers, hidden 64, 8 experts, top-2; --ffn sets the
expert size) with aux-loss-free routing (sigmoid scores, Megatron's expert bias held fixed): experts
in --hot-experts get a bias of --hot-bias, so most tokens pick them. Each rank:
1. runs alltoall EP a few steps and all-reduces the per-expert routing counts it measured, and the
   compute timings (bench/worker.PhaseTimer) that the planner's Workload needs;
2. plans with those counts (plan.planner.choose_plan: equal-size domains + hot-replica variants);
3. per repeat, with the WAN unshaped and then shaped (rank 0 asks the parent over the bench's control
   socket; the other ranks wait at a barrier): alltoall EP, then one hybridep model switching through
   every equal-size domain plan and the best hot-replica plan: warm-up + timed iterations each. A
   step's time is its slowest rank's; WAN bytes come from the DC uplinks' counters over the timed window.
Prints the command, the replicas chosen and a table of medians over repeats (spread = min-max of
the per-repeat medians) with each plan's prediction, made as `hybridep bench` makes it: the plan's
unshaped step + the cost model's shaped minus unshaped network time (bench/predict.py; token
all-to-alls at the share of the rate a bare all-to-all probe got). Results: docs/planner.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TAG = "HOTBENCH "


# ---- one rank -------------------------------------------------------------------------------------
def _skew(spec: dict, state) -> None:  # noqa: ANN001
    import torch

    bias = torch.zeros(spec["experts"])
    bias[spec["hot_experts"]] = spec["hot_bias"]
    with torch.no_grad():
        for layer in state.model.module.decoder.layers:
            layer.mlp.router.expert_bias.copy_(bias)


def _args(spec: dict, dispatcher: str):  # noqa: ANN201
    from megatron_hybridep.plan.model import ModelSpec
    from megatron_hybridep.train.gpt import GPTMoEArgs

    skew = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_bias_update_rate": 0.0}
    return GPTMoEArgs.from_model(ModelSpec(**spec["model"]), micro_batch_size=spec["tokens"] // spec["seq"],
                                 dispatcher=dispatcher, expert_model_parallel_size=spec["world"], extra_config=skew)


def _run(spec: dict, state, batches, iters: int, stats) -> tuple[list[float], float, float, dict]:  # noqa: ANN001
    """Warm-up + timed steps: per-step seconds (slowest rank), WAN tx bytes per step per DC, the
    compute per step: the median step minus this rank's timed collectives (``stats``: token
    all-to-alls both ways, gathers, returns, replica exchanges, finalize_model_grads), slowest rank,
    and rank 0's seconds per step of each of those phases (mean over the timed steps)."""
    import torch
    import torch.distributed as dist

    from megatron_hybridep.bench.worker import wan_counters
    from megatron_hybridep.train.gpt import train_step

    for tokens, labels in batches[: spec["warmup"]]:
        train_step(state, tokens, labels)
    dist.barrier()
    local0 = int(os.environ["LOCAL_RANK"]) == 0
    before = wan_counters()[0] if local0 else 0
    times, compute, last = [], [], time.perf_counter()
    phases0 = {p: stats.seconds_by(phase=p) for p in {p for (_, p, _, _) in stats.records}}
    for tokens, labels in batches[spec["warmup"]:spec["warmup"] + iters]:
        comm = stats.seconds_by()
        train_step(state, tokens, labels)
        now = time.perf_counter()
        times.append(now - last)
        compute.append(now - last - (stats.seconds_by() - comm))
        last = now
    phases = {p: (stats.seconds_by(phase=p) - phases0.get(p, 0.0)) / iters
              for p in {p for (_, p, _, _) in stats.records}}
    dist.barrier()
    tx = torch.tensor([float(wan_counters()[0] - before) if local0 else 0.0])
    t = torch.tensor(times)
    c = torch.tensor([statistics.median(compute)])
    for x in (t, tx, c):
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return t.tolist(), tx.item() / iters, c.item(), phases


def _topology(spec: dict, wan_mbit: float | None = None):  # noqa: ANN202
    """What the planner is told: the shaped WAN at TCP goodput (or ``wan_mbit``, the measured unshaped
    one), intra-DC loopback as 20 Gbit/s."""
    from megatron_hybridep.bench import predict as bp
    from megatron_hybridep.testbed.selfcheck import TCP_GOODPUT_FRACTION

    wan = spec["rate_mbit"] * TCP_GOODPUT_FRACTION if wan_mbit is None else wan_mbit
    return bp.testbed_topology(2, spec["world"] // 2, wan, 20000.0)


def _plan(spec: dict, counts, timer):  # noqa: ANN001, ANN201
    from megatron_hybridep.bench import predict as bp
    from megatron_hybridep.plan.model import ModelSpec
    from megatron_hybridep.plan.planner import choose_plan

    shape = ModelSpec(**spec["model"])
    calib = bp.Calibration(timer["t_pre"], timer["expert_fwd"], timer["expert_rows"])
    work = calib.workload(shape, spec["tokens"], spec["seq"]).replace(routing_counts=counts)
    return work, choose_plan(_topology(spec), work, spec["world"], include_replicated=False)


def _probe(spec: dict, nbytes: int, repeats: int = 15) -> float:
    """Share of the shaped rate a bare gloo all-to-all of ``nbytes`` per rank gets (the bench's probe,
    bench/worker.py): the cost model's time for it over the median measured (slowest rank)."""
    import torch.distributed as dist

    from megatron_hybridep.bench.worker import timed_all_to_alls
    from megatron_hybridep.plan.network import Family, Network

    world = dist.get_world_size()
    n, times = timed_all_to_alls(nbytes, repeats)
    topo = _topology(spec)
    ideal = Network(topo).a2a(Family(topo.level_counts, (1,) * len(topo.levels)), n * 4 / world)
    return ideal.seconds / statistics.median(times)


def _measure_plans(spec: dict, state, stats, batches, world: int):  # noqa: ANN001, ANN202
    """From an alltoall EP run: routing counts and compute timings -> the planner's candidates."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from megatron_hybridep.bench.worker import PhaseTimer

    n = spec["warmup"] + spec["iters"]
    timer = PhaseTimer(state.model.module)
    _run(spec, state, batches, spec["iters"], stats)
    keys = ("t_pre", "expert_fwd", "expert_rows")  # PhaseTimer sums over layers and the n steps
    counts = np.zeros((world, spec["model"]["num_experts"]))  # per layer and step, like Workload's
    counts[dist.get_rank()] = sum(stats.tokens_per_expert.values()) / (len(stats.tokens_per_expert) * n)
    both = torch.tensor(np.concatenate([counts.ravel(), [timer.t[k] / n for k in keys]]))
    dist.all_reduce(both)
    flat = both.numpy()
    counts = flat[:-3].reshape(world, -1)
    work, result = _plan(spec, counts, dict(zip(keys, flat[-3:] / world, strict=True)))
    equal = [c.plan.base for c in result.candidates if not c.plan.replicas]
    hot = [c.plan for c in result.candidates if c.plan.replicas][:1]
    return work, result, counts, sorted(equal, key=lambda p: p.domain_size) + hot


def worker(spec: dict) -> None:
    import torch
    import torch.distributed as dist

    from megatron_hybridep.bench import predict as bp
    from megatron_hybridep.bench.control import CONTROL_ENV, ControlClient
    from megatron_hybridep.data.synthetic import MarkovCorpus
    from megatron_hybridep.megatron import cpu_runtime, grad_sync, setup, teardown
    from megatron_hybridep.megatron.dispatcher import instrument
    from megatron_hybridep.megatron.group_reuse import reuse_megatron_groups
    from megatron_hybridep.plan.phases import Phase
    from megatron_hybridep.runtime.instrument import Stats
    from megatron_hybridep.train.gpt import build, initialize_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec["timeout"]))
    cpu_runtime.enable()
    reuse_megatron_groups()  # 4 builds a repeat: gloo's threads of rebuilt groups would slow the later ones
    rank, world = dist.get_rank(), dist.get_world_size()
    control = ControlClient(os.environ[CONTROL_ENV]) if rank == 0 else None
    corpus = MarkovCorpus(vocab_size=spec["model"]["vocab_size"])
    n = spec["warmup"] + spec["iters"]
    batches = [corpus.batch(spec["tokens"] // spec["seq"], spec["seq"], rank, s) for s in range(n)]
    rows: dict[str, dict[str, list]] = {"shaped": {}, "unshaped": {}}
    plans = delta = None
    for repeat in range(spec["repeats"]):
        # every system unshaped, then shaped: the prediction starts from the unshaped step (as the bench's)
        for shaped in (False, True):
            if control is not None:
                control.request({"op": "rate", "shaped": shaped})
            dist.barrier()  # the rate is set before any rank sends again
            mine = rows["shaped" if shaped else "unshaped"]
            # alltoall EP (the first pass also measures routing and compute for the planner)
            args = _args(spec, "alltoall")
            initialize_parallel(args)
            state = build(args)
            _skew(spec, state)
            stats = Stats()
            for i, layer in enumerate(state.model.module.decoder.layers):
                instrument(layer.mlp.token_dispatcher, stats, i + 1)
            grad_sync.time_megatron_finalize(state.config, partial(stats.add, -1, Phase.DENSE_GRAD_ALLREDUCE, "dp", 0))
            if plans is None:
                work, result, counts, plans = _measure_plans(spec, state, stats, batches, world)
            if shaped and delta is None:
                # shaped minus unshaped network time per plan from the cost model, calibrated as the bench's
                # (bench/predict.py: token all-to-alls and long gradient returns at the probed share of the
                # rate, the dense all-reduce from the model's real dense parameter count)
                eff = _probe(spec, spec["tokens"] * spec["model"]["top_k"] * spec["model"]["hidden_size"] * 4)
                dense = sum(p.numel() for p in state.model.module.parameters() if getattr(p, "allreduce", True))
                unshaped = _topology(spec, spec["unshaped_mbit"])
                delta = {p.label: bp.predict(_topology(spec), unshaped, work, p, dense, 0.0, eff, eff).phases
                         for p in plans}
                delta["alltoall EP"] = delta[next(p.label for p in plans if p.domain_size == 1 and not p.replicas)]
                if rank == 0:
                    print(TAG + json.dumps({
                        "event": "plan", "routing": counts.round(1).tolist(), "chosen": result.best.label,
                        "plans": [p.to_dict() for p in plans], "a2a_efficiency": eff, "dense_params": dense,
                        "planner_total": {c.plan.label: c.cost.total for c in result.candidates},
                        "delta_phases": delta}), flush=True)
            times, tx, compute, phases = _run(spec, state, batches, spec["iters"], stats)
            mine.setdefault("alltoall EP", []).append((statistics.median(times), tx, compute, phases))
            del state
            # hybridep: one model, every plan (switches are exact and rebuild only borrowed copies)
            args = _args(spec, "hybridep")
            initialize_parallel(args)
            runtime = setup(plans, num_experts=args.num_experts)
            state = build(args)
            _skew(spec, state)
            for index, plan in enumerate(plans):
                runtime.switch(index)
                times, tx, compute, phases = _run(spec, state, batches, spec["iters"], runtime.stats)
                mine.setdefault(plan.label, []).append((statistics.median(times), tx, compute, phases))
            teardown()
            del state
        if rank == 0:
            print(TAG + json.dumps({"event": "repeat", "repeat": repeat, "rows": rows}), flush=True)
    dist.barrier()
    if control is not None:
        control.bye()
    dist.destroy_process_group()


# ---- the parent -------------------------------------------------------------------------------------
def _table(rows: dict[str, dict[str, list]], delta: dict[str, dict[str, float]]) -> str:
    """Medians over repeats. predicted = the unshaped step of the same system + the cost model's
    shaped minus unshaped network time (delta), as `hybridep bench` predicts; compute = the shaped
    step minus the timed collectives (slowest rank), for reference."""
    shaped, base = rows["shaped"], rows["unshaped"]
    ep = statistics.median(r[0] for r in shaped["alltoall EP"])
    out = [f"{'system / plan':28s} {'median ms':>10s} {'spread ms':>15s} {'vs EP':>7s} {'WAN MB/iter/DC':>15s} "
           f"{'compute ms':>11s} {'unshaped ms':>12s} {'predicted ms':>13s} {'error':>7s}"]
    for label, runs in shaped.items():
        med = statistics.median(r[0] for r in runs)
        lo, hi = min(r[0] for r in runs), max(r[0] for r in runs)
        mb = statistics.median(r[1] for r in runs) / 1e6
        compute = statistics.median(r[2] for r in runs)
        unshaped = statistics.median(r[0] for r in base[label])
        pred = unshaped + sum(delta[label].values())
        out.append(f"{label:28s} {med * 1e3:10.1f} {f'{lo * 1e3:.0f}-{hi * 1e3:.0f}':>15s} {ep / med:6.2f}x "
                   f"{mb:15.2f} {compute * 1e3:11.1f} {unshaped * 1e3:12.1f} {pred * 1e3:13.1f} {pred / med - 1:+7.1%}")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="50mbit", help="WAN uplink rate per DC (default 50mbit)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank per step (default 1024)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256, help="expert FFN size (default 256: 128 KB experts)")
    p.add_argument("--hot-experts", default="0,4", help="experts that get the bias (default 0,4: one per DC)")
    p.add_argument("--hot-bias", type=float, default=0.3, help="expert bias of the hot experts (sigmoid scores)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1500.0)
    p.add_argument("--out", help="write the measurements as JSON here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(json.loads(a.worker))
        return 0
    from megatron_hybridep.bench.control import launch_controlled
    from megatron_hybridep.testbed.network import Testbed, TestbedConfig
    from megatron_hybridep.testbed.selfcheck import measure_throughput
    from megatron_hybridep.testbed.shaping import parse_rate_mbit
    from megatron_hybridep.train.rank_imports import PRELOAD

    rate = parse_rate_mbit(a.rate)
    if a.tokens % a.seq:
        p.error(f"--tokens ({a.tokens}) must be a multiple of --seq ({a.seq})")
    spec = {"model": {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": a.ffn, "num_attention_heads": 4,
                      "num_experts": 8, "top_k": 2, "vocab_size": 256, "seq_length": a.seq},  # a ModelSpec
            "experts": 8, "hot_experts": [int(x) for x in a.hot_experts.split(",")], "hot_bias": a.hot_bias,
            "tokens": a.tokens, "seq": a.seq, "world": 4, "rate_mbit": rate, "warmup": a.warmup,
            "iters": a.iters, "repeats": a.repeats, "timeout": a.timeout}
    print("command: python " + shlex.join(sys.argv), flush=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, Testbed(TestbedConfig(dcs=2, ranks_per_dc=2, rate_mbit=rate,
                                                                       burst_ms=1.0)) as tb:
        def set_shaped(shaped: bool) -> None:
            for dc in range(2):
                tb.set_rate(dc, rate if shaped else None)

        set_shaped(False)
        spec["unshaped_mbit"] = measure_throughput(tb, 0, 1, seconds=0.4).mbit
        set_shaped(True)

        def handle(request: dict) -> dict:
            if request.get("op") != "rate":
                raise RuntimeError(f"hot_replicas: unexpected control request {request!r}")
            set_shaped(bool(request["shaped"]))
            return {"ok": True}

        res = launch_controlled(tb, [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
                                handle, os.path.join(tmp, "control.sock"), time.monotonic() + a.timeout,
                                env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, timeout_s=a.timeout, cwd=REPO,
                                preload=PRELOAD)
    res.raise_for_status()
    events = [json.loads(line.split(TAG, 1)[1]) for line in res.outputs[0].splitlines() if TAG in line]
    plan = next(e for e in events if e["event"] == "plan")
    rows = [e for e in events if e["event"] == "repeat"][-1]["rows"]
    print(f"testbed 2 DCs x 2 ranks, WAN {a.rate} per DC uplink; {a.tokens} tokens/rank/step, experts of "
          f"{2 * 64 * a.ffn * 4 / 1e3:.0f} KB, hot experts {spec['hot_experts']} (bias {a.hot_bias}); "
          f"{a.warmup} warm-up + {a.iters} timed steps x {a.repeats} repeats, unshaped then shaped "
          f"(unshaped WAN {spec['unshaped_mbit']:.0f} Mbit/s); token all-to-alls at {plan['a2a_efficiency']:.0%} of "
          f"the rate (probe); {time.monotonic() - t0:.0f} s")
    routing = plan["routing"]
    share = [sum(r[e] for r in routing) / max(sum(map(sum, routing)), 1) for e in range(8)]
    print("routing share per expert: " + " ".join(f"{s:.2f}" for s in share))
    hot = [d for d in plan["plans"] if d.get("replicas")]
    if hot:
        print("hot replicas (expert, rank): " + str(hot[0]["replicas"]["pairs"]))
    print(f"planner's choice: {plan['chosen']}")
    print(_table(rows, plan["delta_phases"]))
    if a.out:
        Path(a.out).write_text(json.dumps({"spec": spec, "plan": plan, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
