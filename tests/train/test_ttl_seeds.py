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
