"""Matrix: MoE features real presets use. The DeepSeek-V3 router (sigmoid scores, group-limited
top-k, top-k scaling, an expert bias that finalize_model_grads updates from the tokens each expert
received), shared experts, dense first layers (--moe-layer-freq) and a capacity factor (tokens
over an expert's capacity dropped, with and without padding to capacity)."""

import pytest

from tests.matrix.harness import assert_same_training, train, write_cross_dc_plan

pytestmark = pytest.mark.matrix

FEATURES = {
    "deepseek-v3-router": ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                           "--moe-router-bias-update-rate", "0.01", "--moe-router-num-groups", "2",
                           "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5",
                           "--moe-router-load-balancing-type", "seq_aux_loss"],
    "shared-experts-dense-first": ["--moe-shared-expert-intermediate-size", "64", "--num-layers", "3",
                                   "--moe-layer-freq", "[0,1,1]"],
    "capacity-factor": ["--moe-expert-capacity-factor", "1.0"],
    "capacity-factor-padded": ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"],
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_moe_feature_matches_alltoall(feature, tmp_path):
    plan = write_cross_dc_plan(str(tmp_path / "plan.json"))
    flags = ["--hybridep-fp64", *FEATURES[feature]]
    assert_same_training(train(4, flags, "hybridep", plan=plan), train(4, flags, "alltoall"))
