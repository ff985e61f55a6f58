"""One rank of `hybridep bench`, started by the testbed launcher inside its DC's namespace:

    python -m megatron_hybridep.bench.worker --spec SPEC.json

It trains the real Megatron GPT-MoE (train/gpt.py) and does what the parent says. Rank 0 asks
over the control channel (bench/control) and broadcasts the answer:
- {"op": "next"} -> one system at one point (and, for hybridep, its candidate plans), the WAN
  unshaped: build it, calibrate (warm-up + K iterations of each plan);
- {"op": "shape"} -> the WAN is now shaped; the plans to measure (the planner's choice): warm-up +
  K timed iterations, then tear the model down and ask again, until "done";
- an order marked "trial" (one of auto's finalists) runs the unshaped iterations only.
So each measurement has its unshaped baseline taken seconds before it, on the same model: the
machine's load (shared cores) moves both alike. Rank 0 prints one JSON line per timed iteration and
per point (prefix ``BENCH ``); the parent parses them.

Per point, the cross-DC bytes come from the DC uplink's own counters (/proc/net/dev of this
namespace's wan0, read by each DC's local rank 0 between barriers): the same kernel counters as
Testbed.link_counters(), but read exactly at the edges of the timed window.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_hybridep.bench.config import LAYOUTS
from megatron_hybridep.bench.control import CONTROL_ENV, ControlClient
from megatron_hybridep.bench.predict import MEASURED
from megatron_hybridep.plan.model import ModelSpec
from megatron_hybridep.plan.phases import Phase
from megatron_hybridep.runtime.logs import quiet_known_warnings

PREFIX = "BENCH "
WAN_DEV = "wan0"
SPEED_REF = (256, 48)  # (n, repeats): a fixed fp32 n x n matmul every rank times at once beside each timed window
#   (40-80 ms with 4-8 ranks on 2 cores, longer than a scheduler slice): the shared host's speed then, any layout


def _proc_net_row(path: str, table: str) -> dict[str, int]:
    """One table of /proc/net/snmp or /proc/net/netstat (a header line and a value line per table)."""
    with open(path) as f:
        lines = [line.split() for line in f if line.startswith(table + ":")]
    return dict(zip(lines[0][1:], map(int, lines[1][1:]), strict=True)) if len(lines) == 2 else {}


def wan_counters(dev: str = WAN_DEV) -> tuple[int, int, int, int]:
    """(tx_bytes, rx_bytes, TCP retransmission timeouts, retransmitted segments) of this process's network
    namespace: `dev`'s bytes and the namespace's TCP counters (its DC's senders; a timeout stalls a flow
    for >= 200 ms, which no cost model prices)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == dev:
                fields = rest.split()
                tcp_ext, tcp = _proc_net_row("/proc/net/netstat", "TcpExt"), _proc_net_row("/proc/net/snmp", "Tcp")
                return int(fields[8]), int(fields[0]), tcp_ext.get("TCPTimeouts", 0), tcp.get("RetransSegs", 0)
    raise RuntimeError(f"no interface {dev} in this namespace: run the worker through the testbed launcher")


def _link_delta(dc: int, before: tuple[int, ...], after: tuple[int, ...]) -> dict[str, int]:
    names = ("tx_bytes", "rx_bytes", "tcp_timeouts", "tcp_retrans")
    return {"dc": dc, **{k: a - b for k, a, b in zip(names, after, before, strict=True)}}


def speed_ref(n: int = SPEED_REF[0], repeats: int = SPEED_REF[1]) -> tuple[float, float]:
    """(wall, CPU) seconds this rank takes for ``repeats`` fixed n x n matmuls, started with every rank (a
    barrier): the host's speed at that moment, as auto's trials compare layouts measured minutes apart
    (bench/finalists.trial_step). The slowest rank's wall is the host's throughput for all ranks at once;
    the CPU seconds, a core's speed (they exclude waiting for a core)."""
    a, out = torch.full((n, n), 0.5), torch.empty(n, n)
    torch.mm(a, a, out=out)  # allocate and warm outside the timing
    dist.barrier()
    t, cpu = time.perf_counter(), time.thread_time()
    for _ in range(repeats):
        torch.mm(a, a, out=out)
    return time.perf_counter() - t, time.thread_time() - cpu


def timed_all_to_alls(nbytes: int, repeats: int, before_timed: Any = None) -> tuple[int, list[float]]:
    """A bare all-to-all of ~``nbytes`` per rank over the world, a warm-up then ``repeats`` timed ones
    (``before_timed()`` runs once before them): (elements per rank, each timed call's seconds, slowest
    rank's). All ranks call it; it ends with a barrier."""
    world = dist.get_world_size()
    n = max(nbytes // 4 // world, 1) * world
    x, y, times = torch.ones(n), torch.empty(n), []
    for i in range(repeats + 1):
        dist.barrier()
        if i == 1 and before_timed is not None:
            before_timed()
        t0 = time.perf_counter()
        dist.all_to_all_single(y, x)
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(dt.item())
    dist.barrier()
    return n, times[1:]


class PhaseTimer:
    """Forward-hook timings the cost model is fed with: compute before the experts in each MoE
    layer (T_pre: norms + attention, from the layer's start to its MoE block's start) and the expert
    forward (time and token copies), plus Megatron's gradient finalisation (all-reduces)."""

    def __init__(self, gpt: torch.nn.Module) -> None:
        self.t: dict[str, float] = {}
        self._mark: dict[str, float] = {}
        self.reset()
        for layer in gpt.decoder.layers:
            layer.register_forward_pre_hook(lambda *_: self._start("layer"))
            layer.mlp.register_forward_pre_hook(lambda *_: self._stop("layer", "t_pre"))
            layer.mlp.experts.register_forward_pre_hook(self._experts_in, with_kwargs=True)
            layer.mlp.experts.register_forward_hook(lambda *_: self._stop("experts", "expert_fwd"))

    def reset(self) -> None:
        self.t = {"t_pre": 0.0, "expert_fwd": 0.0, "expert_rows": 0.0, "grad_sync": 0.0}

    def _start(self, key: str) -> None:
        self._mark[key] = time.perf_counter()

    def _stop(self, key: str, into: str) -> None:
        if key in self._mark:
            self.t[into] += time.perf_counter() - self._mark.pop(key)

    def _experts_in(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else next(iter(kwargs.values()))
        self.t["expert_rows"] += float(x.shape[0])
        self._start("experts")

    def time_finalize(self, config: Any) -> None:
        """Megatron's gradient finalisation, timed into ``grad_sync`` (megatron/grad_sync.py)."""
        from megatron_hybridep.megatron import grad_sync

        def add(seconds: float) -> None:
            self.t["grad_sync"] += seconds

        grad_sync.time_megatron_finalize(config, add)


class Worker:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.ranks_per_dc = int(os.environ["LOCAL_WORLD_SIZE"])
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.dc = self.rank // self.ranks_per_dc
        self.control = ControlClient(os.environ[CONTROL_ENV]) if self.rank == 0 else None
        self.unsent: list[dict[str, Any]] = []  # rank 0's events since its last control request
        from megatron_hybridep.data.synthetic import MarkovCorpus

        self.model = ModelSpec(**spec["model"])  # the parent's (bench/cli.py)
        self.corpus = MarkovCorpus(vocab_size=self.model.vocab_size)

    # ---- control ------------------------------------------------------------------------------
    def emit(self, event: str, **fields: Any) -> None:
        """Print an event (the log and the progress lines) and keep it for the next control request:
        the parent decides on the control channel's copy, which cannot lag behind like a pipe reader."""
        record = {"event": event, **fields}
        print(PREFIX + json.dumps(record), flush=True)
        if event != "iter":
            self.unsent.append(record)

    def ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Rank 0 asks the parent; every rank gets the answer."""
        if self.control is not None:
            msg = {**msg, "events": list(self.unsent)}
            self.unsent.clear()
        box = [self.control.request(msg) if self.control is not None else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def run(self) -> None:
        while True:
            order = self.ask({"op": "next"})
            if order.get("done"):
                break
            if "probe" in order:
                self.probe(order["probe"])
                continue
            self.run_system(order)
        if self.control is not None:  # every event went with a "next" request, the last with the final one
            self.control.bye()
        dist.barrier()

    def probe(self, spec: dict[str, Any]) -> None:
        """Bare gloo all-to-alls over all ranks (EP's pattern, no model), one size per point, on the WAN
        as the parent set it (spec "shaped"): time = slowest rank's; counters over the timed repeats."""
        for point, size in enumerate(spec["sizes"]):
            before: list[tuple[int, int]] = []  # rank 0 of a DC: its uplink counters before the timed calls
            n, times = timed_all_to_alls(size, spec["repeats"], (lambda b=before: b.append(wan_counters()))
                                         if self.local_rank == 0 else None)
            link = None
            if before:
                link = _link_delta(self.dc, before[0], wan_counters())
            links: list[Any] = [None] * self.world
            dist.all_gather_object(links, link)
            if self.rank == 0:
                self.emit("probe", point=point, bytes_per_rank=n * 4, repeats=spec["repeats"], step_s=times,
                          median_s=statistics.median(times), link=[c for c in links if c is not None],
                          shaped=spec.get("shaped", True))

    # ---- one system -----------------------------------------------------------------------------
    def _args(self, order: dict[str, Any]) -> Any:
        """GPTMoEArgs of the ordered system: ep / hybridep* over every rank, replicated over a DC's
        ranks, pp / auto / auto-c in the order's layout (stages outermost, as Megatron orders ranks)."""
        from megatron_hybridep.train.gpt import GPTMoEArgs

        system = order["system"]

        def args(**run: Any) -> GPTMoEArgs:
            return GPTMoEArgs.from_model(self.model, seq_length=self.spec["seq"],
                                         overlap_grad_reduce=self.spec.get("overlap_grad_reduce", False), **run)

        if system == "ep":
            return args(dispatcher="alltoall", expert_model_parallel_size=self.world)
        if system == "replicated":  # EP inside each DC (contiguous rank blocks), experts replicated across DCs
            return args(dispatcher="alltoall", expert_model_parallel_size=self.ranks_per_dc)
        if system in ("hybridep", "hybridep-compressed"):
            return args(dispatcher="hybridep", expert_model_parallel_size=self.world)
        if system in LAYOUTS:
            lay = order["layout"]
            return args(dispatcher=order["dispatcher"], expert_model_parallel_size=lay["ep"],
                        pipeline_model_parallel_size=lay["pp"])
        raise ValueError(f"unknown system {system!r}")

    def run_system(self, order: dict[str, Any]) -> None:
        """Build one system, calibrate each of its plans unshaped, then measure the chosen ones shaped."""
        from megatron_hybridep.megatron import setup, teardown
        from megatron_hybridep.megatron.dispatcher import instrument
        from megatron_hybridep.plan.plan import Plan
        from megatron_hybridep.runtime.instrument import Stats
        from megatron_hybridep.train.gpt import build, initialize_parallel

        system, point = order["system"], order["point"]
        args = self._args(order)
        t0 = time.perf_counter()
        initialize_parallel(args)
        runtime = None
        migration, sync_bytes = None, 0.0
        if args.dispatcher == "hybridep":
            plans = [Plan.from_dict(p) for p in order["plans"]]
            if order.get("compression_ratio"):
                migration, sync_bytes = self._migration(order["compression_ratio"],
                                                        order.get("grad_compression_ratio", order["compression_ratio"]),
                                                        order.get("grad_values", "same"),
                                                        order.get("early_grad_return", 0.0))
            elif not self.spec.get("hold_copies", True):
                from megatron_hybridep.runtime.migration import MigrationConfig

                migration = MigrationConfig(hold_copies=False)
            runtime = setup(plans, num_experts=args.num_experts, migration=migration)
        state = build(args)
        gpt = state.model.module
        timer = PhaseTimer(gpt)
        timer.time_finalize(state.config)
        stats = runtime.stats if runtime is not None else Stats()
        if runtime is None:  # Megatron's own dispatcher, measured the same way as hybridep's rails
            ep = args.expert_model_parallel_size
            first = (self.rank // ep) * ep
            levels = tuple("local" if r == self.rank else "dc" if r // self.ranks_per_dc != self.dc else "gpu"
                           for r in range(first, first + ep))
            for i, layer in enumerate(gpt.decoder.layers):
                instrument(layer.mlp.token_dispatcher, stats, i + 1, levels)
        if self.rank == 0:
            dense = sum(p.numel() for p in gpt.parameters() if getattr(p, "allreduce", True))
            experts = sum(p.numel() for p in gpt.parameters() if not getattr(p, "allreduce", True))
            self.emit("model", system=system, point=point["index"], dense_params=dense, expert_params_per_rank=experts,
                 expert_share=experts * args.expert_model_parallel_size
                 / (dense + experts * args.expert_model_parallel_size),  # of the model's parameters
                 ep_size=args.expert_model_parallel_size, pp_size=args.pipeline_model_parallel_size,
                 build_s=time.perf_counter() - t0,
                 compression_ratio=migration.compression_ratio if migration else 1.0,
                 shared_sync_bytes_per_layer=sync_bytes)
        indices = list(range(len(order["plans"]))) if runtime is not None else [None]
        # a trial (an auto system's finalist, bench/finalists.py): its unshaped step only
        for phase in ("trial",) if order.get("trial") else ("calibrate", "measure"):
            if phase == "measure":
                indices = self.ask({"op": "shape"})["measure"]
            for plan_index in indices:
                label = order["layout"]["name"] if "layout" in order else system
                if runtime is not None:
                    runtime.switch(plan_index)
                    label = label if "layout" in order else runtime.plan.label
                self.run_point(phase, system, label, plan_index, point, state, timer, stats,
                               order["warmup"], order["iters"], order.get("micro_batches"))
        if runtime is not None:
            teardown()
        del state
        dist.barrier()

    def _migration(self, ratio: float, grad_ratio: float, grad_values: str,
                   early: float = 0.0) -> tuple[Any, float]:
        """Compressed migration (weights at `ratio`, returned gradients at `grad_ratio`) and its shared-expert
        refresh bytes per MoE layer and step for the cost model (0 when the copies are refreshed
        incrementally, or the shared expert is frozen)."""
        from megatron_hybridep.runtime.compression import SharedExpertRule
        from megatron_hybridep.runtime.migration import MigrationConfig

        cfg = MigrationConfig(compression_ratio=ratio, grad_compression_ratio=grad_ratio, grad_values=grad_values,
                              hold_copies=self.spec.get("hold_copies", True), early_return_rest_ratio=early)
        expert = self.model.expert_params
        sync = 0.0 if cfg.incremental else \
            SharedExpertRule(cfg.shared_refresh_every).sync_bytes_per_step(expert, torch.float32)
        return cfg, sync

    # ---- one point ------------------------------------------------------------------------------
    def run_point(self, phase: str, system: str, label: str, plan_index: int | None, point: dict[str, Any],
                  state: Any, timer: PhaseTimer, stats: Any, warmup: int, iters: int, micro: int | None = None) -> None:
        """``micro``: micro-batches per iteration (default the spec's; a layout with PP runs more, on
        fewer data-parallel ranks: the same global batch)."""
        from megatron_hybridep.train.gpt import train_step

        mbs, seq = point["micro_batch"], point["seq"]
        m = micro or self.spec.get("micro_batches", 1)  # per iteration, each of mbs x seq tokens
        batches = [[self.corpus.batch(mbs, seq, self.rank, step * m + j) for j in range(m)]
                   for step in range(warmup + iters)]
        t0 = time.perf_counter()
        for micro in batches[:warmup]:
            train_step(state, micro)
        dist.barrier()
        warmup_s = time.perf_counter() - t0
        ref = speed_ref()
        load0 = os.getloadavg()[0]  # the machine is shared: say how busy it was
        counters0 = wan_counters() if self.local_rank == 0 else None
        rows, routing = [], {}
        dist.barrier()  # the window starts together; no barrier between steps (training has none)
        last, cpu, use = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        for micro in batches[warmup:]:
            stats.reset()
            timer.reset()
            out = train_step(state, micro)
            for layer, counts in stats.tokens_per_expert.items():  # tokens per expert, this rank, per MoE layer
                routing[layer] = routing.get(layer, 0.0) + counts / (iters * m)
            now, cpu_now, use_now = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
            # cpu_s: the rank's CPU seconds in the step (all its threads): how much of its wall time used a core;
            # sys_s and minflt: the kernel's part of it and the page faults (a point's unshaped step drifts)
            rows.append({"step_s": now - last, "cpu_s": cpu_now - cpu, "sys_s": use_now.ru_stime - use.ru_stime,
                         "minflt": float(use_now.ru_minflt - use.ru_minflt), "loss": out["loss"], **timer.t,
                         **_stats_row(stats)})
            last, cpu, use = now, cpu_now, use_now
        dist.barrier()
        link = None
        if counters0 is not None:
            link = _link_delta(self.dc, counters0, wan_counters())
        ref = tuple((a + b) / 2 for a, b in zip(ref, speed_ref(), strict=True))  # before and after the window
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, {"rank": self.rank, "rows": rows, "link": link, "speed_ref_s": ref,
                                          "routing": {str(k): np.asarray(v).tolist() for k, v in routing.items()}})
        if self.rank != 0:
            return
        links = sorted((e["link"] for e in everyone if e["link"] is not None), key=lambda c: c["dc"])
        # a step's time is its slowest rank's (each rank: end of step i-1 to end of step i)
        steps = [max(e["rows"][i]["step_s"] for e in everyone) for i in range(iters)]
        per_rank = [e["rows"] for e in everyone]
        for i, step in enumerate(steps):  # the loss of the last pipeline stage (earlier ones have none)
            loss = next((r[i]["loss"] for r in per_rank if math.isfinite(r[i]["loss"])), math.nan)
            self.emit("iter", phase=phase, system=system, plan=label, point=point["index"], iter=i, step_s=step,
                      loss=loss)
        self.emit("point", phase=phase, system=system, plan=label, plan_index=plan_index, point=point["index"],
             tokens=mbs * seq, micro_batch=mbs, micro_batches=m, seq=seq, iters=iters, step_s=steps,
             median_s=statistics.median(steps), warmup_s=warmup_s, loadavg=(load0, os.getloadavg()[0]), link=links,
             speed_ref_s=max(e["speed_ref_s"][0] for e in everyone),
             speed_ref_cpu_s=statistics.median(e["speed_ref_s"][1] for e in everyone),
             ranks={k: _mean_over(per_rank, k) for k in per_rank[0][0] if k not in ("step_s", "loss")},
             routing=[e["routing"] for e in sorted(everyone, key=lambda e: e["rank"])])


def _stats_row(stats: Any) -> dict[str, float]:
    """Seconds and inter-DC payload bytes per phase of one step (runtime/instrument.Stats), and the
    expert gathers' issue-to-use time (wall: their launch to their use; less the wait, the compute a
    prefetched gather overlaps), the first MoE layer's apart (its gather launches after the optimizer step)."""
    out: dict[str, float] = {}
    for phase in MEASURED:
        out[f"{phase}_s"] = stats.seconds_by(phase=phase, level="all")
        out[f"{phase}_dc_bytes"] = float(stats.bytes_by(phase=phase, level="dc"))
    gathers = [(layer, r) for (layer, phase, _, level), r in stats.records.items()
               if phase == Phase.EXPERT_ALLGATHER and level == "all"]
    first = min((layer for layer, _ in gathers), default=None)  # launched after the optimizer step
    out[f"{Phase.EXPERT_ALLGATHER}_wall_s"] = sum(r.wall for _, r in gathers)
    out[f"{Phase.EXPERT_ALLGATHER}_calls"] = float(sum(r.calls for _, r in gathers))
    out[f"{Phase.EXPERT_ALLGATHER}_first_lead_s"] = sum(r.wall - r.seconds for layer, r in gathers if layer == first)
    out[f"{Phase.EXPERT_ALLGATHER}_first_calls"] = float(sum(r.calls for layer, r in gathers if layer == first))
    return out


def _mean_over(per_rank: list[list[dict[str, float]]], key: str) -> float:
    """Mean over ranks of the per-step median: one number per point for each measured phase."""
    return statistics.fmean(statistics.median(r[key] for r in rows) for rows in per_rank)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", required=True, help="JSON file written by `hybridep bench`")
    ns = parser.parse_args(argv)
    with open(ns.spec) as f:
        spec = json.load(f)
    quiet_known_warnings()
    torch.set_num_threads(1)  # the ranks share the machine's cores, as torchrun's OMP default does
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec["timeout_s"]))
    from megatron_hybridep.megatron import cpu_runtime
    from megatron_hybridep.megatron.group_reuse import reuse_megatron_groups

    cpu_runtime.enable()
    reuse_megatron_groups()  # a worker builds a system after another: gloo's threads would pile up
    try:
        Worker(spec).run()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
