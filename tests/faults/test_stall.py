"""`python pretrain_moe.py` with one rank SIGSTOPped mid-run fails within the stall timeout, names
the rank, and leaves nothing running (issue 16, section 2)."""

import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _children(pid):
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def _wait_for(predicate, seconds, what):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)  # polling with a deadline, not synchronisation
    raise AssertionError(f"timed out waiting for {what}")


def test_sigstopped_rank_fails_the_job_naming_it(tmp_path):
    log = open(tmp_path / "out.txt", "w+")
    proc = subprocess.Popen([sys.executable, "pretrain_moe.py", "--train-iters", "5000", "--log-interval", "5",
                             "--hybridep-stall-timeout", "8"], cwd=REPO, stdout=log, stderr=subprocess.PIPE,
                            text=True)
    descendants = set()
    try:
        _wait_for(lambda: " iter    10/" in open(tmp_path / "out.txt").read(), 400, "iteration 10")
        ranks = [g for c in _children(proc.pid) for g in _children(c)]  # parent -> forkserver -> 4 ranks
        assert len(ranks) == 4, ranks
        descendants = set(ranks) | set(_children(proc.pid))
        victim = ranks[2]
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=120)
        detect = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"job ended {detect:.1f} s after SIGSTOP (stall timeout 8 s): {err.strip().splitlines()[-1]}")
    assert proc.returncode == 1
    lines = [x for x in err.splitlines() if x.startswith("pretrain_moe.py: error")]
    assert len(lines) == 1 and f"(pid {victim})" in lines[0] and "stopped" in lines[0], err[-2000:]
    assert "Traceback" not in err
    assert 8 <= detect < 30, detect
    # gone or a zombie; the launcher's multiprocessing helpers (resource tracker) may still be exiting
    _wait_for(lambda: not any(map(_running, descendants)), 10, f"the job's processes {sorted(descendants)} to end")


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
