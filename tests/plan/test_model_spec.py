"""ModelSpec, the one description of a model's architecture, and load_model, which reads it from both
YAML formats: configs/models (Workload field names) and configs/presets (Megatron flag names)."""

from __future__ import annotations

import os

import pytest
import yaml

from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.model import ModelSpec, load_model
from megatron_hybridep.plan.presets import load_settings, workload_from_settings
from megatron_hybridep.plan.workload import DEFAULT_THROUGHPUT_TFLOPS, RUN_FIELDS, Workload

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.path.join(ROOT, "configs", "models")
PRESETS = os.path.join(ROOT, "configs", "presets")


def test_paper_l_is_one_model_in_both_formats():
    model, run = load_model(os.path.join(MODELS, "paper-l.yaml"), RUN_FIELDS)
    preset, preset_run = load_model(os.path.join(PRESETS, "paper_l.yaml"))
    # The preset trains with gpu_base.yaml's 32000-row vocabulary; the paper model (and every published
    # `hybridep plan` figure of it) counts no embeddings. Everything else is the same model.
    assert (model.vocab_size, preset.vocab_size) == (0, 32000)
    assert model == preset.replace(vocab_size=0)
    assert (model.num_layers, model.num_moe_layers, model.num_attention_heads, model.top_k) == (12, 12, 16, 2)
    assert (model.name, preset.name) == ("paper-l", "paper_l")
    # the run quantities differ by design: the paper's A800 throughput vs the preset's GPU default
    assert run["throughput_tflops"] == 100 and "throughput_tflops" not in preset_run
    assert preset_run["distributed_optimizer"] and preset_run["weight_bytes"] == 2


@pytest.mark.parametrize("model, preset", [("paper-s", "paper_s"), ("paper-m", "paper_m"), ("paper-xl", "paper_xl")])
def test_the_other_paper_models_agree_with_their_presets(model, preset):
    """configs/models states neither the vocabulary nor (except paper-l) the heads: the rest agrees."""
    a, _ = load_model(os.path.join(MODELS, f"{model}.yaml"), RUN_FIELDS)
    b, _ = load_model(os.path.join(PRESETS, f"{preset}.yaml"))
    assert a == b.replace(vocab_size=0, num_attention_heads=a.num_attention_heads)


@pytest.mark.parametrize("path", [os.path.join(MODELS, "paper-l.yaml"), os.path.join(PRESETS, "paper_l.yaml"),
                                  os.path.join(PRESETS, "deepseek_v3_like.yaml")])
def test_both_formats_reach_the_workload_through_the_spec(path):
    w = Workload.from_yaml(path)
    spec, _ = load_model(path, RUN_FIELDS)
    assert w.model == spec and w.name == spec.name
    if "presets" in path:  # the same as the preset path pretrain_moe.py's planner takes
        assert w == workload_from_settings(load_settings(path), spec.name)


def test_deepseek_preset_layers():
    spec, _ = load_model(os.path.join(PRESETS, "deepseek_v3_like.yaml"))
    assert (spec.num_layers, spec.num_moe_layers, spec.dense_layers, spec.shared_experts) == (60, 58, 2, 1)
    assert spec.gated_mlp and spec.expert_params == 3 * 7168 * 2048 and spec.dense_ffn_hidden_size == 18432


def test_layers_and_dense_ffn_resolve():
    spec = ModelSpec(hidden_size=64, ffn_hidden_size=128, num_experts=8, top_k=2, num_layers=4)
    assert (spec.num_moe_layers, spec.dense_ffn_hidden_size) == (4, 256)
    assert spec == ModelSpec(hidden_size=64, ffn_hidden_size=128, num_experts=8, top_k=2, num_moe_layers=4,
                             num_layers=4, dense_ffn_hidden_size=256, name="other")  # names do not compare
    with pytest.raises(PlanError, match=r"model.num_moe_layers: must be a positive integer.*fix: state num_moe"):
        ModelSpec(hidden_size=64, ffn_hidden_size=128, num_experts=8, top_k=2)
    with pytest.raises(PlanError, match=r"model.num_layers: must be >= num_moe_layers=4"):
        ModelSpec(hidden_size=64, ffn_hidden_size=128, num_experts=8, top_k=2, num_layers=2, num_moe_layers=4)
    with pytest.raises(PlanError, match=r"model.top_k: cannot exceed num_experts=8.*fix"):
        ModelSpec(hidden_size=64, ffn_hidden_size=128, num_experts=8, top_k=9, num_layers=2)


def _write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_a_missing_field_is_named_in_either_format(tmp_path):
    d = yaml.safe_load(open(os.path.join(MODELS, "tiny-cpu.yaml")))
    del d["ffn_hidden_size"]
    with pytest.raises(PlanError, match=r"m.yaml.ffn_hidden_size: required field is missing.*fix: add it"):
        load_model(_write(tmp_path, "m.yaml", d), RUN_FIELDS)
    p = yaml.safe_load(open(os.path.join(PRESETS, "cpu_demo.yaml")))
    del p["hidden_size"]
    with pytest.raises(PlanError, match=r"p.yaml.hidden_size: required to describe the model; fix: set it"):
        load_model(_write(tmp_path, "p.yaml", p))


def test_a_models_file_key_nobody_reads_is_refused(tmp_path):
    d = yaml.safe_load(open(os.path.join(MODELS, "tiny-cpu.yaml")))
    d["num_atention_heads"] = 4
    with pytest.raises(PlanError, match=r"m.yaml.num_atention_heads: unknown key.*'num_attention_heads'"):
        load_model(_write(tmp_path, "m.yaml", d), RUN_FIELDS)


def test_a_preset_base_chain_is_followed(tmp_path):
    child = _write(tmp_path, "child.yaml", {"base": os.path.join(PRESETS, "cpu_demo.yaml"), "num_experts": 16})
    spec, _ = load_model(child)
    assert (spec.num_experts, spec.hidden_size, spec.name) == (16, 64, "child")


def test_one_throughput_default():
    spec, run = load_model(os.path.join(PRESETS, "cpu_demo.yaml"))
    assert Workload.from_model(spec, **run).throughput_tflops == DEFAULT_THROUGHPUT_TFLOPS
    assert Workload.from_model(spec, **run, throughput_tflops=0.05).throughput_tflops == 0.05


@pytest.mark.parametrize("name, heads", [("bench-moe", 2), ("bench-moe-deep", 2)])
def test_bench_models_state_their_heads(name, heads):
    from megatron_hybridep.bench import predict as bp

    spec = bp.load_model(os.path.join(MODELS, f"{name}.yaml"))
    assert (spec.num_attention_heads, spec.vocab_size, spec.name) == (heads, 256, name)


@pytest.mark.parametrize("drop", ["num_attention_heads", "vocab_size"])
def test_a_bench_model_without_heads_or_vocab_is_refused(tmp_path, drop):
    """No guessing: the bench builds the GPT with both, so a file must state them."""
    from megatron_hybridep.bench import predict as bp

    d = yaml.safe_load(open(os.path.join(MODELS, "bench-moe.yaml")))
    del d[drop]
    with pytest.raises(PlanError, match=rf"b.yaml: {drop} must be stated.*fix: write a bench model YAML"):
        bp.load_model(_write(tmp_path, "b.yaml", d))


def test_the_bench_records_the_model_keys_its_runs_always_had():
    from megatron_hybridep.bench import predict as bp

    assert bp.recorded_model(bp.BUILTIN) == {
        "name": "bench-cpu", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 64, "num_attention_heads": 4,
        "num_experts": 8, "topk": 2, "vocab_size": 256}
