"""`hybridep bench --early-grad-return R`: HybridEP-c's ranks split the returned gradients as
pretrain_moe.py's --hybridep-early-grad-return does, the cost model prices the split, and the
command reproduces it (no testbed: the session's planning and orders only)."""

import pytest

from megatron_hybridep.bench.config import BenchError
from tests.testbed.test_bench_finalists import _cfg, _session


def test_the_split_reaches_the_ranks_the_prediction_and_the_command():
    cfg = _cfg(systems="ep,hybridep-compressed", early_grad_return=16, dcs=2)
    assert "--grad-compression-ratio 4 --grad-compression-values bf16 --early-grad-return 16" in cfg.command()
    s = _session(cfg)
    order = s._compressed("hybridep-compressed", {"plans": [{"x": 1}]})
    assert order["early_grad_return"] == 16.0 and order["grad_compression_ratio"] == 4.0
    work = s.workload(cfg.points[1], s.events, "hybridep-compressed")
    assert work.early_return_rest_ratio == 16.0 and work.splits_grad_return("iteration")
    assert s.workload(cfg.points[1], s.events, "ep").early_return_rest_ratio == 0.0  # exact systems: nothing to split



def test_the_split_defaults_to_pretrain_moes_auto_and_the_command_states_it():
    default = _cfg(systems="ep,hybridep-compressed", dcs=2)
    assert default.early_grad_return == 16.0 and "--early-grad-return 16" in default.command()
    off = _cfg(systems="ep,hybridep-compressed", dcs=2, early_grad_return=0)
    assert off.early_grad_return == 0.0 and "--early-grad-return 0" in off.command()  # reruns as it ran
    exact = _cfg(systems="ep,hybridep-compressed", dcs=2, grad_compression_ratio=1)
    assert exact.early_grad_return == 0.0  # exact returns: nothing to split, and no refusal


@pytest.mark.parametrize("bad", [dict(grad_compression_ratio=1), dict(borrowed_copies="microbatch"),
                                 dict(early_grad_return=0.5)])
def test_a_split_without_compressed_returns_held_for_the_iteration_is_refused(bad):
    with pytest.raises(BenchError, match="--early-grad-return"):
        _cfg(**{"early_grad_return": 16, **bad})


@pytest.mark.parametrize("run, early", [("2dc_x_2_deep_5mbit_m8_w10g4b16_reno", 0.0),
                                        ("2dc_x_2_deep_5mbit_m8_w10g4b16_reno_early16", 16.0)])
def test_a_recorded_run_reanalyses_with_the_split_it_ran(run, early):
    """Runs recorded before the split was the default have no flag in their command: one return."""
    from pathlib import Path

    from megatron_hybridep.bench.reanalyse import recorded_session

    out = Path(__file__).resolve().parents[2] / "docs" / "results" / "layout_bench" / run
    _, session = recorded_session(out)
    assert session.cfg.early_grad_return == early
