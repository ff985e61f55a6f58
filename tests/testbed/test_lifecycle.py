"""Bring-up and teardown: everything made is removed, also on exceptions, signals and SIGKILL."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
from testbed_helpers import leftovers, pid_alive, read_until, root_links, spawn_python

from megatron_hybridep.cli import main as hybridep_main
from megatron_hybridep.testbed import netns, shaping
from megatron_hybridep.testbed.network import Testbed, TestbedConfig
from megatron_hybridep.testbed.sh import TestbedError


def test_up_builds_the_network_and_down_removes_everything(prefix):
    before = root_links()
    with Testbed(TestbedConfig(dcs=3, rate_mbit=100, prefix=prefix)) as tb:
        assert sorted(netns.testbed_netns(prefix)) == [f"{prefix}-dc0", f"{prefix}-dc1", f"{prefix}-dc2",
                                                       f"{prefix}-sw"]
        for dc in range(3):
            addrs = subprocess.run(["ip", "-n", tb.netns(dc), "-4", "-br", "addr", "show", "wan0"],
                                   capture_output=True, text=True, check=True).stdout
            assert f"10.77.0.{dc + 1}/24" in addrs
            for ns, dev in ((tb.netns(dc), "wan0"), (tb.switch_netns, f"dc{dc}")):
                shown = shaping.show(ns, dev)
                assert "htb" in shown and "rate 100Mbit" in shown, shown
        assert netns.read_state(prefix)["owner_pid"] > 0
        assert root_links() == before  # nothing ever lands in the root namespace
    assert leftovers(prefix) == []
    assert root_links() == before


def test_teardown_on_exception(prefix):
    with pytest.raises(RuntimeError, match="boom"):
        with Testbed(dcs=2, prefix=prefix):
            assert len(netns.testbed_netns(prefix)) == 3
            raise RuntimeError("boom")
    assert leftovers(prefix) == []


def test_failed_bring_up_cleans_what_it_made(prefix, monkeypatch):
    real_apply = Testbed._apply

    def apply_failing_on_dc1(self, dc, ns, dev, shape):
        if dc == 1:
            raise RuntimeError("tc exploded")
        real_apply(self, dc, ns, dev, shape)

    monkeypatch.setattr(Testbed, "_apply", apply_failing_on_dc1)
    with pytest.raises(RuntimeError, match="tc exploded"):
        Testbed(dcs=3, prefix=prefix).up()
    assert leftovers(prefix) == []


def test_refuses_a_prefix_that_is_taken_and_leaves_it_alone(prefix):
    netns.create_netns(f"{prefix}-dc1")  # made by "someone else"
    with pytest.raises(TestbedError, match=f"down --prefix {prefix}"):
        Testbed(dcs=2, prefix=prefix).up()
    assert netns.testbed_netns(prefix) == [f"{prefix}-dc1"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_teardown_on_signal(prefix, sig):
    proc = spawn_python(
        "import signal\n"
        "from megatron_hybridep.testbed.network import Testbed\n"
        f"with Testbed(dcs=2, prefix={prefix!r}):\n"
        "    print('READY', flush=True)\n"
        "    signal.pause()\n"
    )
    read_until(proc, "READY")
    assert len(netns.testbed_netns(prefix)) == 3
    proc.send_signal(sig)
    proc.wait(timeout=30)
    assert proc.returncode != 0
    assert "TestbedError" not in proc.stderr.read()
    assert leftovers(prefix) == []


KILLED_OWNER = """
import json, sys
from megatron_hybridep.testbed.network import Testbed
tb = Testbed(dcs=2, ranks_per_dc=2, rate_mbit=100, prefix={prefix!r}).__enter__()
sleeper = "import os, time; print('alive', os.getpid(), flush=True); time.sleep(120)"
group = tb.start([sys.executable, "-c", sleeper], timeout_s=120, preload={preload!r})
assert group.wait_output("alive", timeout_s=30)
pids = [int(group.output(r).split()[1]) for r in range(4)]
print("PIDS", json.dumps(pids), flush=True)
import signal; signal.pause()
"""


@pytest.mark.parametrize(("cleanup", "preload"), [("cli-down", []), ("reap-stale", []), ("cli-down", ["json"])])
def test_sigkilled_run_is_cleaned_by_next_cleanup(prefix, cleanup, preload, capsys):
    """preload: the ranks forked from the warm host, which ends with its owner and leaves them running."""
    proc = spawn_python(KILLED_OWNER.format(prefix=prefix, preload=preload))
    pids = json.loads(read_until(proc, r"PIDS (.*)").group(1))
    proc.kill()  # SIGKILL: no handler, no atexit, no teardown
    proc.wait(timeout=10)
    # what a killed run leaves: namespaces, state, and ranks still running inside
    assert len(netns.testbed_netns(prefix)) == 3
    assert all(pid_alive(p) for p in pids)
    assert netns.is_stale(prefix)
    if cleanup == "cli-down":
        assert hybridep_main(["testbed", "down", "--prefix", prefix]) == 0
        assert f"removed {prefix}" in capsys.readouterr().out
    else:
        assert prefix in netns.reap_stale()
    assert leftovers(prefix) == []
    assert not any(pid_alive(p) for p in pids)


def test_live_testbeds_are_not_reaped(prefix):
    with Testbed(dcs=1, prefix=prefix):
        assert not netns.is_stale(prefix)  # owner (this process) is alive
        assert prefix not in netns.reap_stale()
        assert len(netns.testbed_netns(prefix)) == 2
    assert leftovers(prefix) == []
