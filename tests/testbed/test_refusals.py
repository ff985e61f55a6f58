"""Refusals name what is missing and the fix (simulated: these run without root too)."""

from __future__ import annotations

import subprocess

import pytest

from megatron_hybridep.cli import main
from megatron_hybridep.testbed import netns, sh, shaping
from megatron_hybridep.testbed.network import Testbed, TestbedConfig
from megatron_hybridep.testbed.sh import TestbedError


@pytest.fixture
def as_root_with_tools(monkeypatch, tmp_path):
    """Pretend to be root with every tool present; keep state files in tmp_path."""
    monkeypatch.setattr(sh.os, "geteuid", lambda: 0)
    monkeypatch.setattr(sh.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(netns, "state_dir", lambda: tmp_path)


def test_refuses_without_root(monkeypatch, capsys):
    monkeypatch.setattr(sh.os, "geteuid", lambda: 1000)
    with pytest.raises(TestbedError, match="must run as root") as info:
        Testbed(dcs=2).up()
    assert "sudo" in str(info.value) and "--privileged" in str(info.value)
    assert main(["testbed", "up", "--prefix", "hep-refusal"]) == 2
    assert "must run as root" in capsys.readouterr().err


@pytest.mark.parametrize(("tool", "package"), [("tc", "iproute2"), ("ip", "iproute2"), ("timeout", "coreutils")])
def test_refuses_when_a_tool_is_missing(monkeypatch, tool, package):
    monkeypatch.setattr(sh.os, "geteuid", lambda: 0)
    monkeypatch.setattr(sh.shutil, "which", lambda t: None if t == tool else f"/usr/sbin/{t}")
    with pytest.raises(TestbedError) as info:
        Testbed(dcs=2).up()
    msg = str(info.value)
    assert f"'{tool}'" in msg and f"apt-get install {package}" in msg


def test_refuses_when_netns_is_not_permitted(monkeypatch, as_root_with_tools):
    calls = []

    def fake_sh(argv, **kwargs):
        argv = [str(a) for a in argv]
        calls.append(argv)
        if argv[:3] == ["ip", "netns", "add"]:
            raise TestbedError(f"`{' '.join(argv)}` failed (exit 1): mount --make-shared /run/netns "
                               "failed: Operation not permitted")
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(netns, "sh", fake_sh)
    with pytest.raises(TestbedError) as info:
        Testbed(dcs=2, prefix="hep-refusal").up()
    msg = str(info.value)
    assert "not permitted" in msg and "CAP_SYS_ADMIN" in msg and "--privileged" in msg
    assert not (netns.state_dir() / "hep-refusal.json").exists()  # failed bring-up left no state


def test_refuses_delay_without_netem(monkeypatch):
    def fake_sh(argv, **kwargs):
        if "netem" in argv:
            raise TestbedError("`tc ... netem` failed (exit 2): Error: Specified qdisc kind is unknown.")
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(shaping, "sh", fake_sh)
    with pytest.raises(TestbedError) as info:
        shaping.apply("hep-x-dc0", "wan0", shaping.LinkShape(100, delay_ms=5))
    assert "netem" in str(info.value) and "modprobe sch_netem" in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [({"dcs": 0}, "dcs must be"), ({"ranks_per_dc": 0}, "ranks_per_dc"), ({"jitter_ms": 1}, "jitter needs"),
     ({"rate_mbit": [100]}, "1 values for 2 DCs"), ({"subnet": "10.77"}, "subnet"),
     ({"prefix": "Bad Name"}, "bad testbed prefix")],
)
def test_rejects_bad_configs(overrides, match):
    with pytest.raises(TestbedError, match=match):
        Testbed(TestbedConfig(**overrides))


def test_sh_reports_failures_and_timeouts():
    with pytest.raises(TestbedError, match=r"exit 3"):
        sh.sh(["sh", "-c", "echo oops >&2; exit 3"])
    with pytest.raises(TestbedError, match=r"did not finish within 0.2 s"):
        sh.sh(["sleep", "5"], timeout=0.2)
    with pytest.raises(TestbedError, match="not found"):
        sh.sh(["no-such-tool-hep"])
