"""What a training run shows: a progress line every --log-interval iterations (iteration, loss,
step time, tokens/s, the plan, bytes over inter-DC links, exposed communication), TensorBoard
scalars with --tensorboard-dir, and a closing summary."""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_hybridep.plan.cost import bytes_human
from megatron_hybridep.plan.phases import Phase
from megatron_hybridep.train.data import micro_batches
from megatron_hybridep.train.planning import PlanChoice


@dataclass
class RunSummary:
    iterations: int = 0
    first_loss: float = math.nan
    final_loss: float = math.nan
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    inter_dc_bytes: float = 0.0
    inter_dc_by_phase: dict[str, float] = field(default_factory=dict)  # summed over ranks and iterations
    plan: str = ""
    unigram_entropy: float | None = None
    wall_s: float = 0.0
    params: dict[str, torch.Tensor] | None = None  # final parameters, when run(collect_params=True)


class Reporter:
    def __init__(self, args: argparse.Namespace, choice: PlanChoice | None, runtime: Any, rank: int) -> None:
        self.args, self.choice, self.runtime, self.rank = args, choice, runtime, rank
        self.summary = RunSummary(plan=self.plan_label)
        self.tb = None
        if args.tensorboard_dir and rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(args.tensorboard_dir)
        self.tokens_per_iter = args.global_batch_size * args.seq_length
        self.predicted = choice.plan.predicted.get("total") if choice is not None else None
        self._reduced = (math.nan, 0.0, 0.0)  # (loss, inter-DC bytes, exposed s) of the last reduce()
        if rank == 0:
            self._header()

    @property
    def plan_label(self) -> str:
        if self.choice is None:
            return f"Megatron {self.args.moe_token_dispatcher_type} EP={self.args.expert_model_parallel_size}"
        return self.choice.plan.label

    def _header(self) -> None:
        a = self.args
        print(f"[pretrain_moe] GPT-MoE {a.num_layers} layers, hidden {a.hidden_size}, {a.num_experts} experts "
              f"top-{a.moe_router_topk}, world {a.world_size}, EP {a.expert_model_parallel_size}, "
              f"dispatcher {a.moe_token_dispatcher_type}", flush=True)
        if self.choice is not None:
            print(f"[pretrain_moe] topology: {self.choice.topology.describe()} ({self.choice.topology.source})")
            p = self.choice.plan
            print(f"[pretrain_moe] plan: {p.label}; domains {list(p.domains)}; rails {list(p.rails)}"
                  + (f"; predicted {self.predicted * 1e3:.1f} ms/iter" if self.predicted else ""), flush=True)
            m = self.runtime.migration if self.runtime is not None else None
            exact = getattr(self.args, "hybridep_exact_reason", None)
            if exact:
                print(f"[pretrain_moe] {exact}", flush=True)
            elif m is not None and (m.compresses_weights or m.compresses_grads):
                said = (f"compressed migration: {p.borrowed_share:.0%} of the routed tokens computed on compressed "
                        "copies (--hybridep-max-compressed-domain caps it; docs/compression.md)" if p.borrowed_share
                        else "compression asked for, but this plan borrows no experts: nothing is compressed, "
                        "the run is exact")
                print(f"[pretrain_moe] {said}", flush=True)
                micro = micro_batches(self.args, getattr(self.args, "data_parallel_size", None) or 1)
                if p.borrowed_share and m.compresses_grads and m.early_return_rest_ratio and micro > 1:
                    print("[pretrain_moe] returned gradients in two parts: the first M-1 micro-batches' share "
                          "leaves during the last micro-batch, the rest at "
                          f"{m.early_return_rest_ratio:g}x (--hybridep-early-grad-return; 0 turns it off)", flush=True)
            why = getattr(self.args, "hybridep_borrowed_copies_reason", None)
            if why and self.runtime is not None:
                print(f"[pretrain_moe] borrowed copies: {why}", flush=True)
            if self.args.hybridep_log_plan and self.choice.result is not None:
                for c in self.choice.result.candidates:
                    mark = "*" if c.plan == self.choice.plan else " "
                    print(f"   {mark} {c.plan.label:<28} {c.cost.total * 1e3:9.2f} ms")

    def reduce(self, loss: float) -> None:
        """The iteration's collectives for the log, in one all-reduce over the world: the loss (only
        last pipeline stages have one, NaN elsewhere: mean over the ranks that do) and the inter-DC
        bytes per phase (measure.py; every rank runs the same collectives, so the phase lists agree).
        Call from run_iteration's after_step: after it, it would queue behind the next gather."""
        from megatron_hybridep.megatron import measure

        stats = measure.stats() or (self.runtime.stats if self.runtime is not None else None)
        phases = sorted({p for (_, p, _, _) in stats.records} | set(self.summary.inter_dc_by_phase)) if stats else []
        has = loss == loss
        t = torch.tensor([loss if has else 0.0, float(has)] + [float(stats.bytes_by(phase=p, level="dc"))
                                                              for p in phases], dtype=torch.float64)
        dist.all_reduce(t)
        for p, b in zip(phases, t[2:].tolist(), strict=True):
            self.summary.inter_dc_by_phase[p] = self.summary.inter_dc_by_phase.get(p, 0.0) + b
        exposed = 0.0
        if stats is not None and self.runtime is not None:  # this rank's exposed HybridEP communication
            exposed = stats.seconds_by(group="rail") + stats.seconds_by(phase=Phase.EXPERT_ALLGATHER)
        if stats is not None:
            stats.reset()
        self._reduced = ((t[0] / t[1]).item(), float(t[2:].sum().item()), exposed)

    def step(self, iteration: int, seconds: float, grad_norm: Any, scheduler: Any, decision: Any = None) -> None:
        """Record and log the iteration whose ``reduce`` ran last."""
        loss, inter_dc, exposed = self._reduced
        s = self.summary
        s.iterations = iteration
        s.losses.append(loss)
        s.step_times.append(seconds)
        s.inter_dc_bytes += inter_dc
        if iteration == 1:
            s.first_loss = loss
        s.final_loss = loss
        if self.rank != 0:
            return
        lr = scheduler.optimizer.param_groups[0]["lr"]
        tps = self.tokens_per_iter / seconds
        if self.tb is not None:
            for name, value in (("loss", loss), ("step_time_s", seconds), ("tokens_per_s", tps), ("lr", lr),
                                ("inter_dc_bytes", inter_dc), ("exposed_comm_s", exposed)):
                self.tb.add_scalar(f"train/{name}", value, iteration)
            if self.predicted:
                self.tb.add_scalar("train/predicted_step_time_s", self.predicted, iteration)
            if decision is not None:
                self.tb.add_scalar("hybridep/active_plan", self.runtime.active, iteration)
                self.tb.add_scalar("hybridep/predicted_gain_s", decision.replan.gain_seconds, iteration)
        if decision is not None and decision.switched:
            self.summary.plan = self.runtime.plan.label
            self.predicted = self.runtime.plan.predicted.get("total", self.predicted)
            print(f" iter {iteration:5d} | plan switch -> {self.runtime.plan.label}: {decision.replan.reason} "
                  f"(predicted {decision.replan.current_seconds * 1e3:.1f} -> {decision.replan.best_seconds * 1e3:.1f}"
                  " ms/iter)", flush=True)
        if iteration % max(1, self.args.log_interval) == 0 or iteration == self.args.train_iters:
            print(f" iter {iteration:5d}/{self.args.train_iters} | loss {loss:7.4f} | step {seconds * 1e3:7.1f} ms | "
                  f"{tps:9.0f} tok/s | lr {lr:.2e} | grad-norm {float(grad_norm or 0):6.3f} | "
                  f"inter-DC {bytes_human(inter_dc)}/iter | exposed comm {exposed * 1e3:6.1f} ms | "
                  f"plan {self.runtime.plan.label if self.runtime else self.plan_label}", flush=True)

    def finish(self, wall: float) -> Any:
        s = self.summary
        s.wall_s = wall
        if s.step_times:
            s.tokens_per_s = self.tokens_per_iter / statistics.median(s.step_times)
        if self.tb is not None:
            self.tb.close()
        return s
