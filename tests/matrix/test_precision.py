"""Matrix: parameter precision. bf16 (bf16 params, fp32 main grads and main params) and fp16
(dynamic loss scale) against alltoall with the same flags; the tolerance is the oracle's own
bf16/fp16 error against a float64 run of the same job, not a guessed number."""

import pytest

from tests.matrix.harness import assert_same_training, max_differences, train, write_cross_dc_plan

pytestmark = pytest.mark.matrix


@pytest.mark.parametrize("flags", [["--bf16"], ["--fp16", "--initial-loss-scale", "1024"]], ids=["bf16", "fp16"])
def test_half_precision_matches_alltoall_within_its_own_rounding(flags, tmp_path):
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    exact = train(4, ["--hybridep-fp64"], "alltoall")
    oracle = train(4, flags, "alltoall")
    hybrid = train(4, flags, "hybridep", plan=plan)
    loss_err, param_err = max_differences(oracle, exact)  # what the half precision costs alltoall itself
    assert 0 < param_err < 0.1, param_err  # the oracle really ran in half precision, and trained
    loss, param = max_differences(hybrid, oracle)
    assert loss <= loss_err and param <= param_err, (
        f"hybridep vs alltoall ({flags[0]}): loss {loss:.3g} (oracle's own error {loss_err:.3g}), "
        f"params {param:.3g} (oracle's own error {param_err:.3g})")


def test_float64_matches_alltoall_to_float64_precision(tmp_path):
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    assert_same_training(train(4, ["--hybridep-fp64"], "hybridep", plan=plan),
                         train(4, ["--hybridep-fp64"], "alltoall"))
