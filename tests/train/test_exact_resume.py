"""Exact resume (issue 28, item 1): a run resumed with --load from a checkpoint of iteration N (saved
by the uninterrupted run itself, or by a run stopped with --exit-interval N --save) equals the
uninterrupted run bit for bit, losses at every iteration and every parameter, with
the runtime's own state (incremental codec copies, error-feedback residuals, the shared expert and
its refresh counter) and the RNG saved next to Megatron's checkpoint (train/checkpoint.py)."""

import math
import os

import pytest
import torch

from megatron_hybridep.train.checkpoint import latest_iteration
from tests.matrix.harness import max_differences, train, write_cross_dc_plan

pytestmark = pytest.mark.exactness

# float32 (the codec has no float64 values): same machine, same ops in the same order, so bit for
# bit. The shared expert is refreshed every 2 steps: one refresh falls on the save (4), one after it.
COMPRESSED = ["--hybridep-compression-ratio", "10", "--hybridep-grad-compression-ratio", "4",
              "--hybridep-shared-refresh-interval", "2"]
ITERS, STOP = 6, 4


def _stop_and_resume(flags, dispatcher, plan, ckpt, world=4, topology=None, stop_run=False):
    """(loss, parameter) largest differences between the uninterrupted run and a run resumed from
    its checkpoint at STOP to ITERS. The uninterrupted run saves at STOP itself (--save-interval;
    the resumed run loads it with --ckpt-step): a save must not disturb the run that goes on. With
    ``stop_run`` the checkpoint comes from a separate run stopped there (--exit-interval, saving on
    the way out as Megatron does): the same save, one run more."""
    saving = ["--save", ckpt, "--save-interval", str(STOP)]
    full = train(world, [*flags, *([] if stop_run else saving)], dispatcher, plan=plan, topology=topology,
                 iters=ITERS)
    if stop_run:
        stopped = train(world, [*flags, *saving, "--exit-interval", str(STOP)], dispatcher, plan=plan,
                        topology=topology, iters=ITERS)
        assert all(len(losses) == STOP for losses, _ in stopped) and latest_iteration(ckpt) == STOP
    else:
        assert latest_iteration(ckpt) == ITERS  # and STOP's, which --ckpt-step picks
    resumed = train(world, [*flags, "--load", ckpt, "--ckpt-step", str(STOP)], dispatcher, plan=plan,
                    topology=topology, iters=ITERS)
    assert all(len(losses) == ITERS - STOP for losses, _ in resumed)
    assert any(not math.isnan(x) for losses, _ in resumed for x in losses)
    return max_differences(resumed, [(losses[STOP:], params) for losses, params in full])


@pytest.mark.parametrize("extra", [
    # copies held for the iteration (the cases below too); their gradients returned in two parts (M = 2)
    ["--hybridep-early-grad-return", "16"],
    # a gather per micro-batch; the gradients' ratio still warming up at the save (4 ** (4/6))
    ["--hybridep-borrowed-copies", "microbatch", "--hybridep-grad-compression-warmup", "6"],
    # plain top-k (copies seeded with zeros) under the distributed optimizer (its sharded state): one run for both
    ["--hybridep-no-shared-expert", "--use-distributed-optimizer"],
], ids=["iteration-early", "microbatch-warmup", "topk-distopt"])
def test_compressed_run_resumes_bit_for_bit(extra, tmp_path):
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    loss, param = _stop_and_resume([*COMPRESSED, *extra], "hybridep", plan, str(tmp_path / "ckpt"))
    assert loss == 0.0 and param == 0.0, f"resumed vs uninterrupted: loss {loss:.3g}, param {param:.3g}"


def test_compressed_run_with_hot_replicas_resumes_bit_for_bit(tmp_path):
    from megatron_hybridep.plan.plan import Plan

    plan = str(tmp_path / "plan.json")
    Plan.grid((2, 2), (2, 1), 8, ("dc", "gpu")).with_replicas([(0, 1), (0, 3), (1, 3)], max_per_rank=2).save(plan)
    loss, param = _stop_and_resume(COMPRESSED, "hybridep", plan, str(tmp_path / "ckpt"))
    assert loss == 0.0 and param == 0.0, f"resumed vs uninterrupted: loss {loss:.3g}, param {param:.3g}"


@pytest.mark.matrix
def test_compressed_run_with_pipeline_stages_resumes_bit_for_bit(tmp_path):
    """PP 2 x EP 4 on 8 ranks (4 DCs x 2, as tests/matrix/test_parallel.py): each stage's MoE layer
    saves its own codec state."""
    from tests.matrix.harness import write_topology

    topology = write_topology(str(tmp_path / "topo.yaml"), dcs=4, per_dc=2)
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    flags = [*COMPRESSED, "--expert-model-parallel-size", "4", "--pipeline-model-parallel-size", "2",
             "--global-batch-size", "16"]
    loss, param = _stop_and_resume(flags, "hybridep", plan, str(tmp_path / "ckpt"), world=8, topology=topology)
    assert loss == 0.0 and param == 0.0, f"resumed vs uninterrupted: loss {loss:.3g}, param {param:.3g}"


def test_dropout_resumes_bit_for_bit(tmp_path):
    """The RNG comes back: dropout masks after the resume are the uninterrupted run's."""
    flags = ["--hybridep-fp64", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    loss, param = _stop_and_resume(flags, "alltoall", None, str(tmp_path / "ckpt"), stop_run=True)
    assert loss == 0.0 and param == 0.0, f"resumed vs uninterrupted: loss {loss:.3g}, param {param:.3g}"


def _runtime_state(ckpt, iteration, rank):
    path = os.path.join(ckpt, f"iter_{iteration:07d}", "hybridep", f"rank_{rank:05d}.pt")
    return torch.load(path, map_location="cpu", weights_only=True)["runtime"]


def test_compressed_checkpoints_move_between_hybridep_and_alltoall(tmp_path):
    """The runtime's state is a part of its own: alltoall loads a compressed hybridep run's checkpoint
    (ignoring that state) and saves one without it; a hybridep run started from that one starts its
    codec fresh, and trains. One chain: hybridep -> alltoall -> hybridep."""
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    ckpt = str(tmp_path / "ckpt")
    train(4, [*COMPRESSED, "--save", ckpt, "--save-interval", "2", "--exit-interval", "2"], "hybridep",
          plan=plan, iters=5)
    state = _runtime_state(ckpt, 2, 1)
    layer = state["layers"][0]["gathers"][0]  # the codec's copies and residuals
    assert state["step"] == 1 and layer["copies"] is not None and layer["grad_residuals"]
    moved = train(4, ["--load", ckpt, "--save", ckpt, "--save-interval", "2", "--exit-interval", "4"], "alltoall",
                  iters=5)
    assert all(len(losses) == 2 and all(map(math.isfinite, losses)) for losses, _ in moved)
    assert latest_iteration(ckpt) == 4 and _runtime_state(ckpt, 4, 1) is None
    resumed = train(4, [*COMPRESSED, "--load", ckpt], "hybridep", plan=plan, iters=5)
    assert all(len(losses) == 1 and math.isfinite(losses[0]) for losses, _ in resumed)


def _scheduled(ctx, argv):
    """(plan and scheduler state right after --load, or None; plan active at the end; decisions)."""
    import functools

    from megatron_hybridep.megatron.arguments import parse
    from megatron_hybridep.runtime import scheduler
    from megatron_hybridep.runtime.context import process_context
    from megatron_hybridep.train import checkpoint, cpu_loop
    from tests.matrix.harness import PRESET

    # loopback calls take milliseconds: count them as measured rates (as tests/faults' slow-rank test);
    # patience 1: one decision switches, so a noisy decision between two agreeing ones cannot hold the
    # start-up plan to the save (CI once saw ep, ep, domains, ep and no switch under patience 2)
    scheduler.SchedulerConfig = functools.partial(scheduler.SchedulerConfig, min_call_s=0.0, min_gain=0.0,
                                                  patience=1)
    after_load, active, decisions = {}, [], []
    load = checkpoint.load

    def recording_load(*args, **kwargs):
        out = load(*args, **kwargs)
        runtime = process_context().runtime
        after_load.update(plan=runtime.plan.label, state=getattr(runtime.scheduler, "state_dict", dict)())
        return out

    def on_iteration(iteration, seconds, decision):
        active[:] = [process_context().runtime.plan.label]
        if decision is not None:
            decisions.append((iteration, decision.switched, decision.replan.plan.label))

    checkpoint.load = recording_load
    cpu_loop.run(parse(argv, default_config=PRESET), on_iteration=on_iteration)
    return after_load, active[0], decisions


def _same(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_scheduler_resumes_its_plan_and_estimates(tmp_path):
    """A run that switched plans before the save resumes on the plan it switched to, with the
    scheduler's estimates, windows, hysteresis streak, cached cost and pending statistics."""
    from megatron_hybridep.train.launch import run_ranks
    from tests.matrix.harness import REPO

    # a configured WAN far slower than loopback: the start-up plan is wrong once bandwidth is measured,
    # and the first switch comes at iteration 6 (warm-up 3, decisions every 2, a window of 3 samples)
    src = open(os.path.join(REPO, "configs", "topologies", "2dc_x_2.yaml")).read()
    for old in ("bandwidth_gbps: 10\n", "uplink_gbps: 10\n"):
        src = src.replace(old, old.split(":")[0] + ": 0.001\n")
    topo = tmp_path / "slow.yaml"
    topo.write_text(src)
    ckpt = str(tmp_path / "ckpt")
    argv = ["--train-iters", "16", "--log-interval", "100", "--lr-warmup-iters", "1", "--hybridep-replan-interval",
            "2", "--hybridep-replan-replicas", "2", "--hybridep-topology", str(topo), "--save", ckpt,
            "--save-interval", "100"]
    stopped = run_ranks(_scheduled, 4, [*argv, "--exit-interval", "12"], timeout=400)
    _, at_stop, decisions = stopped[0]
    assert any(switched for _, switched, _ in decisions), decisions  # the premise: it left the start-up plan
    resumed = run_ranks(_scheduled, 4, [*argv, "--load", ckpt], timeout=400)
    for rank, (after_load, _, after) in enumerate(resumed):
        assert after_load["plan"] == at_stop, (rank, after_load["plan"], at_stop, decisions)
        saved = torch.load(os.path.join(ckpt, "iter_0000012", "hybridep", f"rank_{rank:05d}.pt"),
                           weights_only=True)["runtime"]["scheduler"]
        assert saved["samples"] and saved["cache"] is not None  # it had measured and costed
        assert _same(after_load["state"], saved), rank
        assert after == resumed[0][2] and all(it > 12 for it, _, _ in after)  # every rank decides the same


def _restored(ctx, argv):
    """Whether --load restored the runtime's state, and this rank's losses."""
    from megatron_hybridep.megatron.arguments import parse
    from megatron_hybridep.train import checkpoint, cpu_loop
    from tests.matrix.harness import PRESET

    seen, load = [], checkpoint.load

    def recording_load(*args, **kwargs):
        out = load(*args, **kwargs)
        seen.append(out[1])
        return out

    checkpoint.load = recording_load
    return seen, cpu_loop.run(parse(argv, default_config=PRESET)).losses


def test_state_saved_under_another_plan_is_ignored(tmp_path):
    """Resumed under another plan, the copies (shaped by the old domains) are not restored: the
    codec starts fresh, and training goes on."""
    from megatron_hybridep.train.launch import run_ranks
    from tests.matrix.harness import TINY

    ckpt = str(tmp_path / "ckpt")
    common = [*TINY, *COMPRESSED, "--train-iters", "3"]
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    saving = ["--save", ckpt, "--save-interval", "2", "--exit-interval", "2"]
    same = run_ranks(_restored, 4, [*common, *saving, "--hybridep-plan", plan], timeout=300)
    assert all(seen == [] for seen, _ in same), same
    other = run_ranks(_restored, 4, [*common, "--hybridep-plan", "ep", "--load", ckpt], timeout=300)
    assert all(seen == [False] and len(losses) == 1 and math.isfinite(losses[0]) for seen, losses in other), other
    again = run_ranks(_restored, 4, [*common, "--hybridep-plan", plan, "--load", ckpt], timeout=300)
    assert all(seen == [True] and len(losses) == 1 for seen, losses in again), again


def test_ckpt_step_without_that_checkpoint_names_the_saved_ones(tmp_path):
    """--ckpt-step N loads iteration N rather than the latest; one not saved (or only half-saved) is
    refused with the iterations there are, before anything is read."""
    import argparse

    from megatron_hybridep.train import checkpoint

    for name in ("iter_0000002", "iter_0000004.partial"):
        (tmp_path / name).mkdir()
    (tmp_path / checkpoint.TRACKER).write_text("2")
    for step in (3, 4):
        with pytest.raises(FileNotFoundError, match=rf"--ckpt-step {step}: .*\(saved: \[2\]\); fix"):
            checkpoint.load(argparse.Namespace(load=str(tmp_path), ckpt_step=step), None, None, None)
