"""`benchmarks/replan_demo.py --smoke` on the testbed (root): a short training run whose WAN rate drops
after iteration 5 switches plan after the drop and never before; the same run with a stable rate
never switches; outputs written, the testbed torn down."""

from __future__ import annotations

import json
import time

import pytest
from testbed_helpers import REPO, leftovers, run_to_end

pytestmark = pytest.mark.slow

LIMIT_S = 120


def test_replan_demo_smoke_switches_after_the_rate_drop_only(root_host, tmp_path):
    t0 = time.monotonic()
    proc, stdout = run_to_end([str(REPO / "benchmarks" / "replan_demo.py"), "--smoke", "--out", str(tmp_path)],
                              LIMIT_S, "replan_demo --smoke")
    assert proc.returncode == 0, stdout[-4000:]
    assert leftovers(f"hep-{proc.pid}") == []
    result = json.loads((tmp_path / "replan_demo_smoke.json").read_text())
    change = result["config"]["change_at"]
    runs = {s["run"]: s for s in result["summaries"]}
    adaptive, stable = runs["adaptive"], runs["stable"]
    assert adaptive["changed_at"] == stable["changed_at"] == change  # the controller answered at that iteration
    assert adaptive["first_plan"] == result["plans"]["a"] and adaptive["switches"], stdout[-3000:]
    first_switch = adaptive["switches"][0][0]
    # after the drop, within a few checks: the first slow iteration's numbers arrive one iteration later
    # (overlapped all-reduce), the median of 3 needs 2 slow samples, and patience 2 a second agreeing check
    assert change < first_switch <= change + 5, adaptive["switches"]
    assert adaptive["last_plan"] == result["plans"]["b"], adaptive
    assert stable["switches"] == [] and stable["last_plan"] == result["plans"]["a"], stable
    assert (tmp_path / "replan_demo_smoke.csv").stat().st_size > 0
    assert "command: python benchmarks/replan_demo.py" in stdout
    print(f"replan_demo --smoke: {time.monotonic() - t0:.1f} s\n{stdout[-2000:]}")
