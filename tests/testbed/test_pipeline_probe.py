"""`benchmarks/pipeline_p2p_probe.py`: Megatron's 1F1B p2p pattern alone on the testbed (root), and its
analysis of the ranks' op logs (no root)."""

from __future__ import annotations

import importlib.util
import re

import pytest
from testbed_helpers import REPO, leftovers, run_to_end


def _probe():
    spec = importlib.util.spec_from_file_location("pipeline_p2p_probe", REPO / "benchmarks" / "pipeline_p2p_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_effective_transfer_time_runs_from_the_later_post_to_the_receive():
    probe = _probe()
    # stage 0 posts the send of a(0) at 1.0, stage 1 posts its receive at 1.5 and has it at 2.0;
    # the gradient g(0) is posted by both at 3.0 and 3.2 and arrives at 3.6
    results = [
        {"offset": 0, "log": [[[["send", ["a", 0, 0]]], 1.0, 1.0], [[["recv", ["g", 0, 0]]], 3.0, 3.6]]},
        {"offset": 0, "log": [[[["recv", ["a", 0, 0]]], 1.5, 2.0], [[["send", ["g", 0, 0]]], 3.2, 3.2]]},
    ]
    eff = probe.effective_times(results)
    assert eff[("a", 0)] == pytest.approx([0.5]) and eff[("g", 0)] == pytest.approx([0.4])
    nominal, fitted = probe.replays(2, 4, 0.1, 0.2, 0.5, eff)
    assert fitted < nominal  # faster messages, shorter replay
    # two stages sharing one core: never faster than with a core each, and as fast with one each
    shared = probe.replays(2, 4, 0.1, 0.2, 0.5, eff, ranks=1, cores=1)
    assert shared[0] > nominal and shared[1] > fitted
    assert probe.replays(2, 4, 0.1, 0.2, 0.5, eff, ranks=1, cores=2) == pytest.approx((nominal, fitted))


@pytest.mark.slow
def test_probe_runs_the_schedule_on_the_testbed(root_host):
    proc, stdout = run_to_end([str(REPO / "benchmarks" / "pipeline_p2p_probe.py"), "--dcs", "3", "--ranks-per-dc", "1",
                               "--rate", "100mbit", "--micro-batches", "4", "--repeats", "1", "--fwd-s", "0.01",
                               "--bwd-s", "0.02", "--busy"], 120, "pipeline_p2p_probe")
    assert proc.returncode == 0, stdout[-3000:]
    assert leftovers(f"hep-{proc.pid}") == []
    run = re.search(r"run 1: measured ([\d.]+) s; replay, nominal transfers ([\d.]+) s .*measured transfers ([\d.]+) s",
                    stdout)
    assert run, stdout
    measured, nominal, fitted = map(float, run.groups())
    assert measured >= (4 + 3 - 1) * 0.03  # never faster than the schedule with free sends
    # each of the 2 boundaries, both directions, 4 messages each
    assert len(re.findall(r"mean +\d+ ms = [\d.]+x nominal \(median \d+, 4 messages\)", stdout)) == 4, stdout
    assert "$ python benchmarks/pipeline_p2p_probe.py" in stdout
    assert re.search(r"on \d+ shared cores: replay, nominal transfers [\d.]+ s", stdout), stdout  # --busy
