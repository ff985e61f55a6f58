"""Matrix: parameter precision. bf16 (bf16 params, fp32 main grads and main params) and fp16
(dynamic loss scale) against alltoall with the same flags; the tolerance is twice the oracle's own
bf16/fp16 error against a float64 run of the same job (harness.assert_within_oracle_rounding), not a
guessed number."""

import pytest

from tests.matrix.harness import assert_same_training, assert_within_oracle_rounding, train, write_cross_dc_plan

pytestmark = pytest.mark.matrix


@pytest.mark.parametrize("flags", [["--bf16"], ["--fp16", "--initial-loss-scale", "1024"]], ids=["bf16", "fp16"])
def test_half_precision_matches_alltoall_within_its_own_rounding(flags, tmp_path):
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    exact = train(4, ["--hybridep-fp64"], "alltoall")
    oracle = train(4, flags, "alltoall")
    hybrid = train(4, flags, "hybridep", plan=plan)
    assert_within_oracle_rounding(hybrid, oracle, exact, f" ({flags[0]})")

def test_float64_matches_alltoall_to_float64_precision(tmp_path):
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    assert_same_training(train(4, ["--hybridep-fp64"], "hybridep", plan=plan),
                         train(4, ["--hybridep-fp64"], "alltoall"))
