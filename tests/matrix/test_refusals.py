"""Combinations that cannot run are refused when arguments are parsed (before any process starts
or any collective runs), with one line naming the flag and the fix."""

import pytest

from megatron_hybridep.megatron.supported import UnsupportedConfiguration, check
from tests.matrix.harness import PRESET, TINY

pytestmark = pytest.mark.matrix


@pytest.mark.parametrize("flags, flag", [
    (["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"], "--expert-tensor-parallel-size"),
    (["--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "2"], "--expert-tensor-parallel-size"),
    (["--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-overlap"], "--moe-shared-expert-overlap"),
    (["--fp8-format", "hybrid"], "--fp8-format"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1",
      "--save", "/nonexistent/ckpt"], "--num-layers-per-virtual-pipeline-stage"),
    (["--hybridep-early-grad-return", "16"], "--hybridep-early-grad-return"),  # exact returns: nothing to split
    (["--hybridep-early-grad-return", "16", "--hybridep-grad-compression-ratio", "4",
      "--hybridep-borrowed-copies", "microbatch"], "--hybridep-early-grad-return"),
])
def test_unsupported_combination_is_refused_at_parse_naming_the_flag(flags, flag):
    from megatron_hybridep.megatron.arguments import parse

    with pytest.raises(UnsupportedConfiguration) as err:
        parse([*TINY, *flags], default_config=PRESET)
    message = str(err.value)
    assert message.startswith(flag + ":") and "fix:" in message and "\n" not in message, message


def test_the_same_flags_pass_with_alltoall_or_the_fix_applied():
    from megatron_hybridep.megatron.arguments import parse

    tp = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"]
    parse([*TINY, *tp, "--moe-token-dispatcher-type", "alltoall"], default_config=PRESET)
    parse([*TINY, *tp, "--expert-tensor-parallel-size", "1"], default_config=PRESET)
    parse([*TINY, "--fp8-format", "hybrid", "--moe-token-dispatcher-type", "alltoall"], default_config=PRESET)
    args = parse([*TINY, "--hybridep-early-grad-return", "16", "--hybridep-grad-compression-ratio", "4"],
                 default_config=PRESET)
    assert args.hybridep_early_grad_return == 16.0
    args = parse([*TINY, "--pipeline-model-parallel-size", "2", "--num-layers", "4"], default_config=PRESET)
    args.num_layers_per_virtual_pipeline_stage, args.save = 1, "/nonexistent/ckpt"
    check(args, cpu=False)  # a CPU-loop limit only: Megatron's own loop runs virtual stages
