"""The warm host (testbed/warm_host.py): ranks forked from a process that imported their modules once
behave as `ip netns exec <ns> timeout <T> python ...` ranks do. test_launcher.py runs its launcher
tests both ways; these check what only the host does."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
from testbed_helpers import leftovers, pid_alive

from megatron_hybridep.testbed import warm_host
from megatron_hybridep.testbed.launcher import PER_RANK_ENV
from megatron_hybridep.testbed.network import Testbed

PRELOAD = ["wave"]  # cheap, and imported by nothing else: these tests are about the host, not its imports


@pytest.fixture
def tb(prefix):
    with Testbed(dcs=2, ranks_per_dc=1, rate_mbit=200, prefix=prefix) as testbed:
        yield testbed
    assert leftovers(prefix) == []


def _host() -> warm_host.WarmHost:
    return warm_host.host_for(PRELOAD, {**os.environ, "OMP_NUM_THREADS": "1"}, PER_RANK_ENV)


SEEN = (
    "import json, os, sys\n"
    "print(json.dumps({'argv': sys.argv, 'name': __name__, 'path0': sys.path[0], 'cwd': os.getcwd(),\n"
    "                  'ppid': os.getppid(), 'pgid': os.getpgid(0), 'pid': os.getpid(),\n"
    "                  'preloaded': 'wave' in sys.modules,\n"
    "                  'X': os.environ.get('X')}))\n"
    "sys.exit(int(sys.argv[1]))\n"
)


def test_a_hosted_script_sees_what_python_would_give_it(tb, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(SEEN)
    work = tmp_path / "work"
    work.mkdir()
    result = tb.launch([sys.executable, str(script), "3"], preload=PRELOAD, env={"X": "y"}, cwd=work,
                       timeout_s=60, fail_fast=False)
    assert result.returncodes == [3, 3]
    parents = set()
    for out in result.outputs:
        seen = json.loads(out)
        assert seen["argv"] == [str(script), "3"] and seen["name"] == "__main__"
        assert seen["path0"] == str(tmp_path) and seen["cwd"] == str(work) and seen["X"] == "y"
        parents.add(seen["ppid"])
        assert seen["pgid"] == seen["pid"]  # leads its own process group
        assert seen["preloaded"]
    (host,) = parents  # both forked by the host, not started cold
    assert "warm_host import serve" in Path(f"/proc/{host}/cmdline").read_text()


def test_module_and_code_forms_and_their_exit_codes(tb, tmp_path):
    (tmp_path / "rank_mod.py").write_text("import sys\nprint('module', __name__, sys.argv[1:])\n")
    env = {"PYTHONPATH": str(tmp_path)}
    result = tb.launch([sys.executable, "-m", "rank_mod", "a"], preload=PRELOAD, env=env, timeout_s=60,
                       cwd=tmp_path)
    assert result.ok and all("module __main__ ['a']" in out for out in result.outputs), result.outputs
    code = "import os\nif os.environ['RANK'] == '1': raise ValueError('boom')\nraise SystemExit('bye')"
    result = tb.launch([sys.executable, "-c", code], preload=PRELOAD, timeout_s=60, fail_fast=False)
    assert result.returncodes == [1, 1]
    assert "bye" in result.outputs[0]
    assert "Traceback" in result.outputs[1] and "ValueError: boom" in result.outputs[1]


def test_a_hosted_rank_ends_by_its_alarm(tb):
    """What ends a rank whose launcher was SIGKILLed (test_lifecycle.py kills one)."""
    proc = _host().spawn([sys.executable, "-c", "import signal; signal.pause()"], dict(os.environ), None,
                         tb.netns(0), alarm_s=1)
    assert proc.wait(timeout=30) == -signal.SIGALRM


def test_closing_a_host_ends_it_and_the_ranks_it_can_no_longer_report(tb):
    host = _host()
    proc = host.spawn([sys.executable, "-c", "import signal; signal.pause()"], dict(os.environ), None,
                      tb.netns(0), alarm_s=60)
    assert proc.poll() is None and pid_alive(proc.pid)
    host.close()
    assert host.proc.returncode == 0  # it saw its channel close and left (not killed after close's wait)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert _host() is not host  # a closed host is replaced


def test_one_host_per_import_relevant_environment(tb):
    code = "import os; print(os.getppid())"
    first = tb.launch([sys.executable, "-c", code], preload=PRELOAD, env={"HYBRIDEP_ANY": "1"}, timeout_s=60)
    again = tb.launch([sys.executable, "-c", code], preload=PRELOAD, env={"HYBRIDEP_ANY": "2"}, timeout_s=60)
    other = tb.launch([sys.executable, "-c", code], preload=PRELOAD, env={"OMP_NUM_THREADS": "2"}, timeout_s=60)
    parents = [{int(out) for out in r.outputs} for r in (first, again, other)]
    assert all(len(p) == 1 for p in parents)
    assert parents[0] == parents[1] != parents[2]


def test_other_commands_run_cold(tb):
    result = tb.launch(["/bin/sh", "-c", "echo $PPID"], preload=PRELOAD, timeout_s=60)
    assert result.ok
    assert not warm_host.hostable(["/bin/sh", "-c", "x"])
    assert not warm_host.hostable([sys.executable, "-u", "x.py"])
    assert warm_host.hostable([sys.executable, "x.py"]) and warm_host.hostable([sys.executable, "-m", "x"])
