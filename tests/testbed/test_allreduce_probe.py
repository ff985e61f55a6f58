"""`benchmarks/allreduce_probe.py`: the replicated layout's gradient all-reduces alone on the testbed (root)."""

from __future__ import annotations

import re

import pytest
from testbed_helpers import REPO, leftovers, run_to_end


@pytest.mark.slow
def test_probe_reduces_both_buffers_across_the_dcs(root_host):
    expert, dense = 100_000, 10_000
    proc, stdout = run_to_end([str(REPO / "benchmarks" / "allreduce_probe.py"), "--rate", "100mbit",
                               "--expert-params", str(expert), "--dense-params", str(dense), "--repeats", "2",
                               "--runs", "1"], 120, "allreduce_probe")
    assert proc.returncode == 0, stdout[-3000:]
    assert leftovers(f"hep-{proc.pid}") == []
    run = re.search(r"run 1: slowest rank's median ([\d.]+) s; ([\d.]+) MB per uplink and pair", stdout)
    assert run, stdout
    seconds, mb = map(float, run.groups())
    # both ranks of a DC send their expert buffer across (a 2-rank all-reduce moves it once each way):
    # at least that crossed, and it took at least its time at the shaped rate
    assert mb >= 2 * expert * 4 / 1e6
    assert seconds >= 2 * expert * 4 * 8 / 100e6
    assert len(re.findall(r"^  rank \d: [\d.]+ [\d.]+ s$", stdout, re.M)) == 4, stdout
    assert "$ python benchmarks/allreduce_probe.py" in stdout
