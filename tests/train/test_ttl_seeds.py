"""benchmarks/ttl_seeds.py: quality over seeds from time_to_loss.py's results.json files (no runs)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def seeds():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("ttl_seeds", BENCH / "ttl_seeds.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def _results(path: Path, seed: int, early, runs: dict[str, list[float]]) -> str:
    data = {"args": {"seed": seed, "early_grad_return": early, "grad_ratio": 4.0},
            "runs": {name: [[[i + 1, loss, 1.0] for i, loss in enumerate(curve)]] for name, curve in runs.items()}}
    path.write_text(json.dumps(data))
    return str(path)


REF = [5.0, 4.0, 3.0, 2.0]  # moving mean of 1: the target at 0.75 of the run is 3.0, reached at step 3


def test_steps_and_loss_per_seed_and_the_mean_over_seeds(seeds, tmp_path):
    files = [_results(tmp_path / "a.json", 1, 0.0, {"replicated": REF, "hybridep-c": [5.0, 4.0, 3.5, 2.02]}),
             _results(tmp_path / "b.json", 1, 16.0, {"hybridep-c": [5.0, 4.0, 3.0, 2.0],
                                                     "replicated (recorded)": [9.0] * 4}),  # skipped
             _results(tmp_path / "c.json", 2, None, {"replicated": REF, "hybridep-c": [5.0, 4.0, 2.9, 2.04]})]
    out = seeds.table(seeds.curves(files), "replicated", 0.75, 1)
    assert "| 1 | 3.0000 | 4 / +1.00% | 3 / +0.00% |" in out  # off: one step more; split: the same curve
    assert "| 2 | 3.0000 | - | 3 / +2.00% |" in out  # no flag after the default: auto, the split at 16
    assert "hybridep-c: 1 seeds, loss +1.00%, worst seed 1 +1.00%; steps to the target 1.333x" in out
    assert "hybridep-c early 16: 2 seeds, loss +1.00%, 95% interval [-11.71%, +13.71%], worst seed 2 +2.00%" in out
    assert "paired" not in out  # one seed in common: no interval


def test_systems_are_compared_paired_on_the_seeds_both_ran(seeds, tmp_path):
    files = [_results(tmp_path / f"{s}_{early:g}.json", s, early,
                      {"replicated": REF, "hybridep-c": [5.0, 4.0, 3.0, 2.0 + d]})
             for s, early, d in ((1, 0.0, 0.02), (2, 0.0, 0.04), (1, 16.0, 0.04), (2, 16.0, 0.08))]
    assert "paired" not in seeds.table(seeds.curves(files[:2]), "replicated", 0.75, 1)  # one system
    out = seeds.table(seeds.curves(files), "replicated", 0.75, 1)
    assert "hybridep-c early 16 - hybridep-c, paired over 2 seeds: +1.50 points of loss change" in out, out


def test_one_system_with_two_curves_for_a_seed_is_refused(seeds, tmp_path):
    files = [_results(tmp_path / "a.json", 1, 0.0, {"replicated": REF}),
             _results(tmp_path / "b.json", 1, 0.0, {"replicated": [5.0, 4.0, 3.0, 2.5]})]
    with pytest.raises(SystemExit, match="replicated at seed 1 ran before with another curve"):
        seeds.curves(files)


def _timed(path: Path, seed: int, runs: dict[str, tuple[list[float], float]], systems: str) -> str:
    """A results.json whose systems ran at fixed step seconds; target 3.0 (moving mean of 1)."""
    data = {"args": {"seed": seed, "early_grad_return": 0.0, "grad_ratio": 4.0, "window": 1, "warmup": 0,
                     "systems": systems},
            "target": 3.0,
            "runs": {name: [[[i + 1, loss, step] for i, loss in enumerate(curve)]]
                     for name, (curve, step) in runs.items()}}
    path.write_text(json.dumps(data))
    return str(path)


def test_time_to_the_target_is_paired_within_each_file(seeds, tmp_path):
    files = [_timed(tmp_path / "a.json", 1, {"replicated": (REF, 2.0), "hybridep-c": (REF, 1.0)},
                    "replicated,hybridep-c"),  # both reach 3.0 at step 3: 6 s against 3 s
             _timed(tmp_path / "b.json", 2, {"hybridep-c": ([5.0, 4.0, 3.5, 2.9], 1.0),  # one step more
                                             "replicated": (REF, 4.0)}, "hybridep-c"),  # joined: recorded
             _timed(tmp_path / "c.json", 3, {"hybridep-c": ([5.0, 4.0, 3.5, 3.4], 1.0), "replicated": (REF, 1.0)},
                    "replicated,hybridep-c")]  # never reaches it
    out = seeds.speedups(files, "replicated")
    assert f"| 1 | hybridep-c | 2.00x | this run | {files[0]} |" in out
    assert f"| 2 | hybridep-c | 3.00x | recorded | {files[1]} |" in out  # 12 s against 4 s
    assert f"| 3 | hybridep-c | not reached | - | {files[2]} |" in out
    assert "hybridep-c: 2 runs, 2.50x sooner than replicated, 95% interval [" in out and "range 2.00-3.00x" in out
