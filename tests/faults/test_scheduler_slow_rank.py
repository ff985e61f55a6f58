"""The scheduler switches plans while one rank is slow: every rank decides the same (the decision
is a function of all-reduced measurements), nobody waits on a decision the others did not take."""

import os
import threading

from megatron_hybridep.train.launch import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESET = os.path.join(REPO, "configs", "presets", "cpu_demo.yaml")


def _run(ctx, argv):
    import functools

    from megatron_hybridep.megatron.arguments import parse
    from megatron_hybridep.runtime import scheduler
    from megatron_hybridep.train import cpu_loop

    # loopback calls take milliseconds: let them count as measured rates, not as overhead-bound ones;
    # measured, the plans are within a few % of each other (compute-bound): any gain switches
    scheduler.SchedulerConfig = functools.partial(scheduler.SchedulerConfig, min_call_s=0.0, min_gain=0.0)

    decisions = []

    def on_iteration(iteration, seconds, decision):
        if ctx.rank == 1:
            threading.Event().wait(0.1)  # rank 1 is slow: 100 ms more per step than its peers
        if decision is not None:
            decisions.append((iteration, decision.switched, decision.replan.plan.label, decision.compute_s))

    cpu_loop.run(parse(argv, default_config=PRESET), on_iteration=on_iteration)
    return decisions


def test_slow_rank_during_a_plan_switch_all_ranks_decide_the_same(tmp_path):
    # a configured WAN far slower than loopback: the start-up plan is wrong once bandwidth is measured
    src = open(os.path.join(REPO, "configs", "topologies", "2dc_x_2.yaml")).read()
    topo = tmp_path / "slow.yaml"
    for old in ("bandwidth_gbps: 10\n", "uplink_gbps: 10\n"):
        src = src.replace(old, old.split(":")[0] + ": 0.001\n")
    topo.write_text(src)
    argv = ["--train-iters", "16", "--log-interval", "100", "--lr-warmup-iters", "1",
            "--hybridep-replan-interval", "2", "--hybridep-topology", str(topo)]
    per_rank = run_ranks(_run, 4, argv, timeout=400)
    assert all(d == per_rank[0] for d in per_rank), per_rank
    assert any(switched for _, switched, _, _ in per_rank[0]), per_rank[0]
