"""The plan scheduler: decisions are a pure function of all-reduced measurements, switch when a
measured change makes another plan cheaper by more than the switch cost, never under stable
conditions, never on alternating noise (hysteresis), and a switch mid-training is exact."""

import os

import numpy as np
import pytest
import torch

from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.topology import Topology
from megatron_hybridep.plan.workload import Workload
from megatron_hybridep.runtime.instrument import Stats
from megatron_hybridep.runtime.scheduler import Measurement, PlanScheduler, SchedulerConfig, per_rank_gbps
from megatron_hybridep.testing.exactness import FP64_TOL, scaled_error
from megatron_hybridep.train.launch import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TOPO = Topology.from_yaml(os.path.join(REPO, "configs", "topologies", "2dc_x_8.yaml"))
WORK = Workload.from_yaml(os.path.join(REPO, "configs", "models", "paper-s.yaml")).replace(
    tokens_per_rank=1024)
EP = Plan.grid((2, 8), (1, 1), 32, ("dc", "gpu"))
ACROSS = Plan.grid((2, 8), (2, 1), 32, ("dc", "gpu"))


class FakeRuntime:
    def __init__(self, plans, active):
        self.plans, self.active, self.switches, self.stats = plans, active, [], Stats()

    @property
    def plan(self):
        return self.plans[self.active]

    def switch(self, index):
        self.switches.append(index)
        self.active = index

    def adopt(self, plan):
        if plan not in self.plans:
            self.plans.append(plan)
        return self.plans.index(plan)


def _m(tokens_per_rank, dc_gbps=10.0, gpu_gbps=64.0):
    """A measurement: balanced routing of `tokens_per_rank` (top-2) and blocking collectives that
    ran at the given per-rank rates."""
    secs = 0.1
    per_rank = lambda gbps: gbps * 1e9 / 8 * secs  # noqa: E731
    routing = np.full((16, 32), tokens_per_rank * 2 / 32)
    return Measurement(routing, {"dc": 16 * per_rank(dc_gbps), "gpu": 16 * per_rank(gpu_gbps)},
                       {"dc": secs, "gpu": secs})


def _scheduler(active, **cfg):
    rt = FakeRuntime([EP, ACROSS], active)
    return rt, PlanScheduler(rt, TOPO, WORK, SchedulerConfig(interval=1, min_bytes=0, **cfg))


def test_measured_bandwidth_and_routing_are_what_was_measured():
    _, s = _scheduler(0, smoothing=1.0)
    s.update_estimates(_m(1024, dc_gbps=2.5))
    assert s.bandwidth_gbps["dc"] == pytest.approx(2.5)
    # the level is scaled so that one rank's share of the DC uplink (8 ranks behind it) is what was measured
    assert per_rank_gbps(s.measured_topology(), 0) == pytest.approx(2.5)
    assert s.measured_topology().levels[0].uplink_gbps == pytest.approx(TOPO.levels[0].uplink_gbps * 2.5 / 1.25)
    assert s.routing.sum() == pytest.approx(16 * 1024 * 2)


def test_stable_conditions_never_switch():
    rt, s = _scheduler(0)  # 1024 tokens per rank: plain EP is the cheapest plan
    for it in range(30):
        s.update_estimates(_m(1024))
        s.decide(it)
    assert rt.switches == [], [d.replan.reason for d in s.history if d.switched]
    assert all(d.replan.plan == EP for d in s.history)


def test_a_change_in_token_volume_switches_after_patience_and_only_once():
    rt, s = _scheduler(0, patience=3, smoothing=1.0)
    s.update_estimates(_m(1024))
    assert not s.decide(0).switched
    for it in range(1, 4):  # batches grow 16x (e.g. a longer-sequence phase): token traffic dominates
        s.update_estimates(_m(16384))
        d = s.decide(it)
        assert d.switched == (it == 3), (it, d.replan.reason)
    assert rt.switches == [1] and rt.plan == ACROSS
    assert "gain" in s.history[-1].replan.reason
    for it in range(4, 12):  # same conditions: no flapping back
        s.update_estimates(_m(16384))
        s.decide(it)
    assert rt.switches == [1]


def test_alternating_conditions_do_not_flap():
    rt, s = _scheduler(0, patience=2, smoothing=1.0)
    for it in range(12):
        s.update_estimates(_m(16384 if it % 2 else 1024))
        s.decide(it)
    assert rt.switches == []


# ---- exactness across a switch, on 4 ranks with Megatron DDP --------------------------------------
def _train(ctx, switch_at, steps):
    from megatron_hybridep.data.synthetic import MarkovCorpus
    from megatron_hybridep.megatron import cpu_runtime, setup, teardown
    from megatron_hybridep.train.gpt import GPTMoEArgs, build, initialize_parallel, train_step

    cpu_runtime.enable()
    args = GPTMoEArgs(expert_model_parallel_size=4, dispatcher="hybridep", params_dtype=torch.float64)
    initialize_parallel(args)
    plans = [Plan.grid((2, 2), (1, 1), 8, ("dc", "gpu")), Plan.grid((2, 2), (2, 1), 8, ("dc", "gpu")),
             Plan.grid((2, 2), (2, 2), 8, ("dc", "gpu"))]
    runtime = setup(plans)
    state = build(args)
    corpus, losses, used = MarkovCorpus(), [], []
    for step in range(steps):
        if switch_at is not None and step in switch_at:
            to = switch_at[step]  # a prebuilt plan's index, or a hot variant to adopt (no new groups)
            runtime.switch(runtime.adopt(plans[1].with_replicas(to)) if isinstance(to, list) else to)
        runtime.stats.reset()
        losses.append(train_step(state, *corpus.batch(4, 64, ctx.rank, step))["loss"])
        used.append((runtime.plan.label, runtime.stats.bytes_by(phase="replica_weights")))
    teardown()
    return losses, {n: p.detach().clone() for n, p in state.model.module.named_parameters()}, used


@pytest.mark.exactness
def test_switching_plans_mid_run_is_exact():
    """float64, to FP64_TOL (megatron_hybridep/testing/exactness.py): plans differ only in summation order."""
    fixed = run_ranks(_train, 4, None, 6, timeout=300)
    # EP -> pairs across DCs -> the pairs plan + replicas of experts 2 and 7 (adopted mid-run) -> all four
    switched = run_ranks(_train, 4, {2: 1, 3: [(2, 0), (7, 2)], 4: 2}, 6, timeout=300)
    labels = [label for label, _ in switched[0][2]]
    assert labels[3].endswith("+2 hot") and labels[4] != labels[3], labels
    replica_bytes = [sum(rank[2][step][1] for rank in switched) for step in range(6)]  # sent, all ranks
    assert replica_bytes[3] > 0 and replica_bytes[3] == sum(replica_bytes), replica_bytes  # the hot plan ran
    for (la, pa, _), (lb, pb, _) in zip(fixed, switched, strict=True):
        assert scaled_error(torch.tensor(lb), torch.tensor(la)) <= FP64_TOL, (la, lb)
        for name in pa:
            assert pa[name].dtype == torch.float64 and scaled_error(pb[name], pa[name]) <= FP64_TOL, name
