"""benchmarks/collective_call_probe.py: gloo's cost per collective call beyond its bytes (what
Workload.collective_overhead_ms prices); a tiny run that must finish and print its table."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_probe_times_both_loops_and_prints_the_command(tmp_path):
    out = tmp_path / "probe.json"
    args = ["--ranks", "2", "--compute-ms", "0.2", "--bytes", "4096", "--calls", "3", "--repeats", "2",
            "--json", str(out)]
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "collective_call_probe.py"), *args],
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith("$ python benchmarks/collective_call_probe.py --ranks 2")
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["compute_ms"] == 0.2
    # both loops ran: each chunk took time, and the loop with a call per chunk is not free of it
    assert rows[0]["base_ms"] > 0 and rows[0]["call_ms"] > 0
    assert rows[0]["overhead_min_ms"] <= rows[0]["overhead_ms"] <= rows[0]["overhead_max_ms"]


def test_probe_refuses_a_single_rank():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "collective_call_probe.py"), "--ranks", "1"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and "--ranks >= 2" in proc.stderr
