"""The multi-rank harness: results by rank, every failing rank's traceback, hangs fail fast with
the hung rank's stack, and no process is left behind."""

import os
import threading
import time

import pytest

from megatron_hybridep.train.launch import RankFailure, run_ranks


def _record_pid(ctx, pid_dir):
    with open(os.path.join(pid_dir, str(ctx.rank)), "w") as f:
        f.write(str(os.getpid()))


def _allreduce(ctx, pid_dir):
    import torch
    import torch.distributed as dist

    _record_pid(ctx, pid_dir)
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    return ctx.rank, t.item()


def _raise_on_rank_one(ctx, pid_dir):
    import torch
    import torch.distributed as dist

    _record_pid(ctx, pid_dir)
    if ctx.rank == 1:
        raise ValueError("rank one is broken")
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here: its peer never joins


def _hang_on_rank_zero(ctx, pid_dir):
    _record_pid(ctx, pid_dir)
    if ctx.rank == 0:
        threading.Event().wait()  # never set: a genuine hang
    return "done"


def _assert_all_gone(pid_dir):
    for name in os.listdir(pid_dir):
        pid = int(open(os.path.join(pid_dir, name)).read())
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        with open(f"/proc/{pid}/stat") as f:  # a reaped-but-listed zombie is not a leak
            assert f.read().split()[2] == "Z", f"rank {name} (pid {pid}) still running"


def test_results_come_back_by_rank(tmp_path):
    assert run_ranks(_allreduce, 3, str(tmp_path), timeout=60) == [(0, 6.0), (1, 6.0), (2, 6.0)]
    _assert_all_gone(str(tmp_path))


def test_spawned_ranks_give_the_same_results(tmp_path):
    # CUDA ranks are spawned (a forked child cannot use CUDA once its parent has)
    assert run_ranks(_allreduce, 2, str(tmp_path), timeout=120, start_method="spawn") == [(0, 3.0), (1, 3.0)]


def test_failure_reports_traceback_and_stops_peers(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_on_rank_one, 2, str(tmp_path), timeout=60)
    assert "rank one is broken" in info.value.reports[1]
    assert 0 in info.value.reports  # the blocked peer is reported, not waited on for 60 s
    assert time.monotonic() - start < 40
    _assert_all_gone(str(tmp_path))


def test_hang_fails_fast_with_stack(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_hang_on_rank_zero, 2, str(tmp_path), timeout=4)
    assert time.monotonic() - start < 30
    assert "_hang_on_rank_zero" in info.value.reports[0]  # the hung rank's stack
    assert 1 not in info.value.reports
    _assert_all_gone(str(tmp_path))


def _stall_rank_one(ctx, pid_dir, iterations):
    import signal

    import torch
    import torch.distributed as dist

    from megatron_hybridep.train.launch import progress

    _record_pid(ctx, pid_dir)
    for it in range(iterations):
        progress(it, "forward")
        if ctx.rank == 1 and it == 3:
            os.kill(os.getpid(), signal.SIGSTOP)  # stalled mid-iteration, as `kill -STOP` would
        dist.all_reduce(torch.ones(1))
        progress(it, "all-reduce done", step_seconds=0.001)
    return "done"


def test_stalled_rank_is_named_and_everything_stops(tmp_path):
    from megatron_hybridep.train.launch import StallFailure, StallRule

    start = time.monotonic()
    with pytest.raises(StallFailure) as info:
        run_ranks(_stall_rank_one, 3, str(tmp_path), 10**6, timeout=300, stall=StallRule(fixed=3.0))
    elapsed = time.monotonic() - start
    assert info.value.stalled == [1]
    report = info.value.reports[1]
    assert "rank 1 (pid" in report and "iteration 3, phase 'forward'" in report and "stopped" in report, report
    assert "waiting for stalled rank(s) [1]" in info.value.reports[0]
    assert elapsed < 60  # 3 s stall timeout + start-up on a loaded machine; the run timeout is 300 s
    _assert_all_gone(str(tmp_path))


def test_stall_rule_defaults_scale_with_step_time():
    from megatron_hybridep.train.launch import StallRule

    rule = StallRule()
    assert rule.seconds() == 60.0  # floor: never shorter than a minute by default
    assert rule.seconds(median_step=12.0) == 120.0  # a 12 s (WAN) step: 10 steps
    assert rule.seconds(median_step=0.1, predicted_step=40.0) == 120.0  # before measurements: the prediction
    assert StallRule(fixed=5.0).seconds(median_step=100.0) == 5.0


def _slow_but_alive(ctx, pid_dir):
    import torch
    import torch.distributed as dist

    from megatron_hybridep.train.launch import progress

    _record_pid(ctx, pid_dir)
    for it in range(3):
        progress(it, "step", step_seconds=2.5)
        if ctx.rank == 0:
            threading.Event().wait(timeout=2.5)  # a slow step (e.g. a WAN collective), not a stall
        dist.all_reduce(torch.ones(1))
    return "done"


def test_slow_steps_do_not_trip_the_derived_stall_timeout(tmp_path):
    from megatron_hybridep.train.launch import StallRule

    # floor 1 s would trip on a 2.5 s step, but 10 x the measured median (25 s) does not
    rule = StallRule(floor=1.0)
    assert run_ranks(_slow_but_alive, 2, str(tmp_path), timeout=120, stall=rule) == ["done", "done"]


def _num_threads(ctx):
    import torch

    return torch.get_num_threads()


def test_rank_threads_default_to_one_and_follow_the_environment(monkeypatch):
    """The exactness tests are run with 1 and 2 intra-op threads (docs/testing.md)."""
    monkeypatch.delenv("HYBRIDEP_RANK_THREADS", raising=False)
    assert run_ranks(_num_threads, 1, timeout=60) == [1]
    monkeypatch.setenv("HYBRIDEP_RANK_THREADS", "2")
    assert run_ranks(_num_threads, 1, timeout=60) == [2]
    assert run_ranks(_num_threads, 1, timeout=60, threads=3) == [3]
