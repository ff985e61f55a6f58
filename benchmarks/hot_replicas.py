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
3. per repeat: alltoall EP, then one hybridep model switching through every equal-size domain plan
   and the best hot-replica plan: warm-up + timed iterations each. A step's time is its slowest
   rank's; WAN bytes come from the DC uplinks' counters over the timed window.
Prints the command, the replicas chosen and a table of medians over repeats (spread = min-max of
the per-repeat medians).

Measured (2 shared cores, load average 2.6-16 during the run; 153 s):
    sudo python benchmarks/hot_replicas.py --tokens 1024 --hot-bias 0.2 --iters 5 --warmup 2 --repeats 3
routing: experts 0 and 4 get 50% each (every token picks both); planner: ep (S=1) +6 hot
(experts 0 and 4 replicated to the 3 other ranks each).

    system / plan        median ms   spread ms   vs EP   WAN MB/iter/DC
    alltoall EP             1194.9   1154-1236   1.00x   4.97
    ep (S=1) (hybridep)     1190.0   1145-1229   1.00x   4.97
    domains dc2 gpu1         690.7     682-707   1.73x   2.69
    domains dc1 gpu2        1247.3   1147-1265   0.96x   4.95
    domains dc2 gpu2         968.8    893-1017   1.23x   4.36
    ep (S=1) +6 hot          619.8     614-634   1.93x   2.51
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from datetime import timedelta
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
    from megatron_hybridep.train.gpt import GPTMoEArgs

    skew = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_bias_update_rate": 0.0}
    return GPTMoEArgs(**spec["model"], micro_batch_size=spec["tokens"] // spec["seq"], dispatcher=dispatcher,
                      expert_model_parallel_size=spec["world"], extra_config=skew)


def _run(spec: dict, state, batches, iters: int) -> tuple[list[float], float]:  # noqa: ANN001
    """Warm-up + timed steps: per-step seconds (slowest rank) and WAN tx bytes per step per DC."""
    import torch
    import torch.distributed as dist

    from megatron_hybridep.bench.worker import wan_counters
    from megatron_hybridep.train.gpt import train_step

    for tokens, labels in batches[: spec["warmup"]]:
        train_step(state, tokens, labels)
    dist.barrier()
    local0 = int(os.environ["LOCAL_RANK"]) == 0
    before = wan_counters()[0] if local0 else 0
    times, last = [], time.perf_counter()
    for tokens, labels in batches[spec["warmup"]:spec["warmup"] + iters]:
        train_step(state, tokens, labels)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    dist.barrier()
    tx = torch.tensor([float(wan_counters()[0] - before) if local0 else 0.0])
    t = torch.tensor(times)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.all_reduce(tx, op=dist.ReduceOp.MAX)
    return t.tolist(), tx.item() / iters


def _plan(spec: dict, counts, timer):  # noqa: ANN001, ANN201
    from megatron_hybridep.bench import predict as bp
    from megatron_hybridep.plan.planner import choose_plan
    from megatron_hybridep.testbed.selfcheck import TCP_GOODPUT_FRACTION

    shape = bp.ModelShape(**{k: v for k, v in spec["model"].items() if k != "seq_length"})
    calib = bp.Calibration(timer["t_pre"], timer["expert_fwd"], timer["expert_rows"])
    work = calib.workload(shape, spec["tokens"], spec["seq"]).replace(routing_counts=counts)
    topo = bp.testbed_topology(2, spec["world"] // 2, spec["rate_mbit"] * TCP_GOODPUT_FRACTION, 20000.0)
    return choose_plan(topo, work, spec["world"], include_replicated=False)


def worker(spec: dict) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from megatron_hybridep.bench.worker import PhaseTimer
    from megatron_hybridep.data.synthetic import MarkovCorpus
    from megatron_hybridep.megatron import cpu_runtime, setup, teardown
    from megatron_hybridep.megatron.dispatcher import instrument
    from megatron_hybridep.runtime.instrument import Stats
    from megatron_hybridep.train.gpt import build, initialize_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec["timeout"]))
    cpu_runtime.enable()
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = MarkovCorpus(vocab_size=spec["model"]["vocab_size"])
    n = spec["warmup"] + spec["iters"]
    batches = [corpus.batch(spec["tokens"] // spec["seq"], spec["seq"], rank, s) for s in range(n)]
    rows: dict[str, list] = {}
    plans = None
    for repeat in range(spec["repeats"]):
        # alltoall EP (the first repeat also measures routing and compute for the planner)
        args = _args(spec, "alltoall")
        initialize_parallel(args)
        state = build(args)
        _skew(spec, state)
        if plans is None:
            stats, timer = Stats(), PhaseTimer(state.model.module)
            for i, layer in enumerate(state.model.module.decoder.layers):
                instrument(layer.mlp.token_dispatcher, stats, i + 1)
            _run(spec, state, batches, spec["iters"])
            keys = ("t_pre", "expert_fwd", "expert_rows")  # PhaseTimer sums over layers and the n steps
            counts = np.zeros((world, spec["model"]["num_experts"]))  # per layer and step, like Workload's
            counts[rank] = sum(stats.tokens_per_expert.values()) / (len(stats.tokens_per_expert) * n)
            both = torch.tensor(np.concatenate([counts.ravel(), [timer.t[k] / n for k in keys]]))
            dist.all_reduce(both)
            flat = both.numpy()
            counts = flat[:-3].reshape(world, -1)
            result = _plan(spec, counts, dict(zip(keys, flat[-3:] / world, strict=True)))
            equal = [c.plan.base for c in result.candidates if not c.plan.replicas]
            hot = [c.plan for c in result.candidates if c.plan.replicas][:1]
            plans = sorted(equal, key=lambda p: p.domain_size) + hot
            if rank == 0:
                print(TAG + json.dumps({"event": "plan", "routing": counts.round(1).tolist(),
                                        "chosen": result.best.label, "plans": [p.to_dict() for p in plans],
                                        "predicted": {c.plan.label: c.cost.total for c in result.candidates}}),
                      flush=True)
            del timer
        times, tx = _run(spec, state, batches, spec["iters"])
        rows.setdefault("alltoall EP", []).append((statistics.median(times), tx))
        del state
        # hybridep: one model, every plan (switches are exact and rebuild only borrowed copies)
        args = _args(spec, "hybridep")
        initialize_parallel(args)
        runtime = setup(plans, num_experts=args.num_experts)
        state = build(args)
        _skew(spec, state)
        for index, plan in enumerate(plans):
            runtime.switch(index)
            times, tx = _run(spec, state, batches, spec["iters"])
            rows.setdefault(plan.label, []).append((statistics.median(times), tx))
        teardown()
        del state
        if rank == 0:
            print(TAG + json.dumps({"event": "repeat", "repeat": repeat, "rows": rows}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ---- the parent -------------------------------------------------------------------------------------
def _table(rows: dict[str, list]) -> str:
    ep = statistics.median(t for t, _ in rows["alltoall EP"])
    out = [f"{'system / plan':28s} {'median ms':>10s} {'spread ms':>15s} {'vs EP':>7s} {'WAN MB/iter/DC':>15s}"]
    for label, runs in rows.items():
        med = statistics.median(t for t, _ in runs)
        lo, hi = min(t for t, _ in runs), max(t for t, _ in runs)
        mb = statistics.median(b for _, b in runs) / 1e6
        out.append(f"{label:28s} {med * 1e3:10.1f} {f'{lo * 1e3:.0f}-{hi * 1e3:.0f}':>15s} {ep / med:6.2f}x "
                   f"{mb:15.2f}")
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
    from megatron_hybridep.testbed.network import Testbed, TestbedConfig
    from megatron_hybridep.testbed.shaping import parse_rate_mbit

    rate = parse_rate_mbit(a.rate)
    if a.tokens % a.seq:
        p.error(f"--tokens ({a.tokens}) must be a multiple of --seq ({a.seq})")
    spec = {"model": {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": a.ffn, "num_attention_heads": 4,
                      "num_experts": 8, "topk": 2, "vocab_size": 256, "seq_length": a.seq},
            "experts": 8, "hot_experts": [int(x) for x in a.hot_experts.split(",")], "hot_bias": a.hot_bias,
            "tokens": a.tokens, "seq": a.seq, "world": 4, "rate_mbit": rate, "warmup": a.warmup,
            "iters": a.iters, "repeats": a.repeats, "timeout": a.timeout}
    print("command: python " + shlex.join(sys.argv), flush=True)
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    with Testbed(TestbedConfig(dcs=2, ranks_per_dc=2, rate_mbit=rate, burst_ms=1.0)) as tb:
        res = tb.launch([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)], env=env,
                        timeout_s=a.timeout, cwd=REPO)
    res.raise_for_status()
    events = [json.loads(line.split(TAG, 1)[1]) for line in res.outputs[0].splitlines() if TAG in line]
    plan = next(e for e in events if e["event"] == "plan")
    rows = [e for e in events if e["event"] == "repeat"][-1]["rows"]
    print(f"testbed 2 DCs x 2 ranks, WAN {a.rate} per DC uplink; {a.tokens} tokens/rank/step, experts of "
          f"{2 * 64 * a.ffn * 4 / 1e3:.0f} KB, hot experts {spec['hot_experts']} (bias {a.hot_bias}); "
          f"{a.warmup} warm-up + {a.iters} timed steps x {a.repeats} repeats; {time.monotonic() - t0:.0f} s")
    routing = plan["routing"]
    share = [sum(r[e] for r in routing) / max(sum(map(sum, routing)), 1) for e in range(8)]
    print("routing share per expert: " + " ".join(f"{s:.2f}" for s in share))
    hot = [d for d in plan["plans"] if d.get("replicas")]
    if hot:
        print("hot replicas (expert, rank): " + str(hot[0]["replicas"]["pairs"]))
    print(f"planner's choice: {plan['chosen']}")
    print(_table(rows))
    if a.out:
        Path(a.out).write_text(json.dumps({"spec": spec, "plan": plan, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
