"""Every training preset pairs with a topology and a parallel layout on which some plan fits the
memory of its GPUs (the planner refuses the rest), and uses only supported Megatron configurations."""

from __future__ import annotations

import glob
import os

import pytest

from megatron_hybridep.plan.cost import CostModel
from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.presets import fit, load_settings, moe_layer_count, workload_from_settings
from megatron_hybridep.plan.supported import GOVERNED, SUPPORTED, unsupported
from megatron_hybridep.plan.topology import Topology

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESETS = sorted(glob.glob(os.path.join(REPO, "configs", "presets", "*.yaml")))
CPU_TOPOLOGY = "configs/topologies/2dc_x_2.yaml"  # train/planning.py's built-in CPU default


def _paired(settings):
    return Topology.from_yaml(os.path.join(REPO, settings.get("hybridep_topology", CPU_TOPOLOGY)))


def test_every_preset_is_checked():
    names = {os.path.basename(p) for p in PRESETS}
    assert {"paper_s.yaml", "paper_m.yaml", "paper_l.yaml", "paper_xl.yaml", "deepseek_v3_like.yaml",
            "gpu_base.yaml", "cpu_demo.yaml"} <= names


@pytest.mark.parametrize("path", PRESETS, ids=os.path.basename)
def test_preset_uses_only_supported_configurations(path):
    assert unsupported(load_settings(path)) == []


@pytest.mark.parametrize("path", [p for p in PRESETS if not p.endswith("gpu_base.yaml")], ids=os.path.basename)
def test_preset_fits_its_paired_topology(path):
    settings = load_settings(path)
    topo = _paired(settings)
    assert topo.memory_gb_per_gpu is not None, "the paired topology states its memory per GPU"
    lay, result = fit(settings, topo, os.path.basename(path))
    limit = topo.memory_bytes
    chosen = result.chosen
    assert chosen.fits_memory and chosen.cost.memory.total <= limit
    assert lay.ep * lay.pp * lay.tp * lay.dp // lay.ep == topo.world_size
    header = open(path, encoding="utf-8").read().split("\n\n")[0]
    assert "Paired topology" in header and f"EP {lay.ep} x PP {lay.pp} x TP {lay.tp}, DP {lay.dp}" in header
    assert "Fits" in header


def test_gpu_base_pairs_through_the_presets_that_extend_it():
    extending = [p for p in PRESETS if open(p, encoding="utf-8").read().count("base: gpu_base.yaml")]
    assert len(extending) >= 5
    header = open(os.path.join(REPO, "configs", "presets", "gpu_base.yaml"), encoding="utf-8").read()
    assert "pairs with a topology and a layout through each preset that extends it" in header


def test_deepseek_preset_did_not_fit_the_paper_testbed_and_fits_its_own():
    settings = load_settings(os.path.join(REPO, "configs", "presets", "deepseek_v3_like.yaml"))
    old = dict(settings, expert_model_parallel_size=32, pipeline_model_parallel_size=1)
    with pytest.raises(PlanError, match=r"memory_limit: no plan fits 80 GB per rank .*memory_gb_per_gpu"):
        fit(old, Topology.from_yaml(os.path.join(REPO, "configs", "topologies", "4dc_x_8.yaml")))
    lay, result = fit(settings, _paired(settings))
    assert (lay.ep, lay.pp) == (128, 4) and result.layout.spans_dcs  # the EP group crosses DCs
    assert any(c.plan.domain_size > 1 and c.fits_memory for c in result.candidates)
    assert any(not c.fits_memory for c in result.candidates)  # large domains are refused


def test_memory_counts_weights_copies_grads_optimizer_and_dense_with_their_sharding():
    settings = load_settings(os.path.join(REPO, "configs", "presets", "deepseek_v3_like.yaml"))
    w = workload_from_settings(settings, data_parallel_size=128)
    assert (w.num_moe_layers, w.stage_moe_layers, w.shared_experts, w.micro_batches) == (58, 15, 1, 16)
    topo = _paired(settings)
    model = CostModel(topo, w)
    assert model.topology.world_size == 128 and model.dp == 128  # one stage of 2 DCs
    _, result = fit(settings, topo)
    plan = next(c.plan for c in result.candidates if c.plan.domain_size == 2)
    P = 2 * w.expert_params * 15  # 2 experts per rank, 15 MoE layers on the busiest stage
    it, mb = model.memory(plan, mode="iteration"), model.memory(plan, mode="microbatch")
    assert it.owned_weights == P * 2 and it.borrowed_weights == P * 2  # bf16 params, one borrowed copy each
    assert it.grads == P * 4  # fp32 main grads
    assert it.borrowed_grads == 2 * P * 4  # the accumulator of S x own experts for the iteration
    assert mb.borrowed_grads == P / 15 * 2  # one layer's borrowed gradients in flight
    assert it.optimizer_state == P * 12  # expert DP = 128 / 128 = 1: nothing to shard over
    dense = w.model_dense_params / 4
    assert it.dense_weights == pytest.approx(dense * 2) and it.dense_grads == pytest.approx(dense * 4)
    assert it.dense_optimizer_state == pytest.approx(dense * 12 / 128)  # distributed optimizer over DP
    plain = CostModel(topo, w.replace(distributed_optimizer=False)).memory(plan, mode="iteration")
    assert plain.dense_optimizer_state == pytest.approx(dense * 12)
    tp2 = CostModel(topo, w.replace(tensor_model_parallel_size=2)).memory(plan, mode="iteration")
    assert tp2.owned_weights == pytest.approx(it.owned_weights / 2) and tp2.dense_weights == pytest.approx(
        it.dense_weights / 2)


def test_moe_layer_freq_and_bad_settings():
    assert moe_layer_count(60, "([0]*2+[1]*58)") == 58 and moe_layer_count(12, 2) == 6 and moe_layer_count(4, None) == 4
    with pytest.raises(PlanError, match="moe_layer_freq"):
        moe_layer_count(60, "([0]*3+[1]*58)")
    with pytest.raises(PlanError, match="moe_layer_freq"):
        moe_layer_count(4, "__import__('os')")
    assert unsupported({"tensor_model_parallel_size": 2}) == [
        "tensor_model_parallel_size: needs sequence_parallel: True (got None); fix: set it"]
    assert unsupported({"tensor_model_parallel_size": 2, "sequence_parallel": True}) == []
    assert unsupported({"fp16": True})[0].startswith("fp16: True is not in the supported configurations")
    assert unsupported({"recompute_granularity": "everything"})[0].startswith("recompute_granularity:")


def test_presets_may_overlap_the_data_parallel_reductions():
    """Issue 25: --overlap-grad-reduce, and --overlap-param-gather with what Megatron requires of it."""
    assert unsupported({"overlap_grad_reduce": True}) == []
    assert unsupported({"overlap_grad_reduce": True, "overlap_param_gather": True,
                        "use_distributed_optimizer": True}) == []
    assert unsupported({"overlap_grad_reduce": True, "overlap_param_gather": True}) == [
        "overlap_param_gather: needs use_distributed_optimizer: True (got None); fix: set it"]
    assert unsupported({"overlap_grad_reduce": False}) == []
    # and the planner (pretrain_moe's prediction, preset fits) prices them as set
    base = load_settings(os.path.join(REPO, "configs", "presets", "cpu_demo.yaml"))
    assert not workload_from_settings(base).overlap_grad_reduce
    w = workload_from_settings({**base, "overlap_grad_reduce": True, "overlap_param_gather": True,
                                "use_distributed_optimizer": True})
    assert w.overlap_grad_reduce and w.overlap_param_gather


def test_supported_entries_name_tests_that_exist():
    for entry in SUPPORTED:
        if entry.test:
            path, _, name = entry.test.partition("::")
            with open(os.path.join(REPO, path)) as f:
                assert f"def {name.split('[')[0]}(" in f.read(), entry.test


def test_supported_list_is_one_place_with_the_issue_entries():
    keys = {s.key for s in SUPPORTED}
    assert {"bf16", "use_distributed_optimizer", "tensor_model_parallel_size", "sequence_parallel",
            "pipeline_model_parallel_size", "recompute_granularity", "moe_router_score_function",
            "moe_shared_expert_intermediate_size", "moe_layer_freq", "moe_expert_capacity_factor",
            "overlap_grad_reduce", "overlap_param_gather"} <= keys
    assert keys <= set(GOVERNED)


def test_topology_memory_field_is_validated_by_name():
    data = {"levels": [{"name": "gpu", "count": 2, "bandwidth_gbps": 10}], "memory_gb_per_gpu": -1}
    with pytest.raises(PlanError, match=r"topology.memory_gb_per_gpu: must be > 0.*fix: give the memory of one GPU"):
        Topology.from_dict(data)
    with pytest.raises(PlanError, match=r"memory_gb_per_gpu: expected a finite number"):
        Topology.from_dict(dict(data, memory_gb_per_gpu="80GB"))
    topo = Topology.from_dict(dict(data, memory_gb_per_gpu=80))
    assert topo.memory_bytes == 80e9 and Topology.from_dict(topo.to_dict()).memory_gb_per_gpu == 80
    assert topo.with_counts((4,)).memory_gb_per_gpu == 80
