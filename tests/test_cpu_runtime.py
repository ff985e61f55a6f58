"""The CPU runtime: idempotent, reversible, and never applied when CUDA is available."""

import importlib

import pytest
import torch

from megatron_hybridep.megatron import cpu_runtime


@pytest.fixture
def clean_runtime():
    cpu_runtime.disable()
    yield
    cpu_runtime.disable()


def test_not_applied_when_cuda_available(monkeypatch, clean_runtime):
    router = importlib.import_module("megatron.core.transformer.moe.router")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_runtime.enable() is False
    assert not cpu_runtime.is_enabled()
    assert router.torch is torch
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    assert dispatcher.maybe_move_tensor_to_cpu.__module__.startswith("megatron.")


def test_enable_twice_is_harmless_and_disable_restores(clean_runtime):
    router = importlib.import_module("megatron.core.transformer.moe.router")
    clip = importlib.import_module("megatron.core.optimizer.optimizer").clip_grad_by_total_norm_fp32
    assert cpu_runtime.enable() is True
    shim = router.torch
    assert shim is not torch and shim.cuda.current_device() == "cpu"
    assert cpu_runtime.enable() is True
    assert router.torch is shim  # not wrapped twice
    cpu_runtime.disable()
    assert router.torch is torch
    assert importlib.import_module("megatron.core.optimizer.optimizer").clip_grad_by_total_norm_fp32 is clip


def test_shim_maps_cuda_devices_to_cpu(clean_runtime):
    cpu_runtime.enable()
    shim = importlib.import_module("megatron.core.optimizer.grad_scaler").torch
    assert shim.tensor([1.0], device="cuda").device.type == "cpu"
    assert shim.zeros(2, device=shim.cuda.current_device()).device.type == "cpu"
    assert isinstance(shim.device("cuda"), torch.device)
    assert shim.device("cuda").type == "cpu"
    assert shim.float32 is torch.float32


def test_every_patch_names_an_upstream_function():
    listing = cpu_runtime.patched_modules()
    assert len(listing) >= 10
    assert all(isinstance(v, str) and v for v in listing.values())
    for name in listing:  # each entry is an importable module or module.attribute
        try:
            importlib.import_module(name)
        except ImportError:
            module, attr = name.rsplit(".", 1)
            assert hasattr(importlib.import_module(module), attr), name


def test_clip_grad_on_cpu_scales_like_upstream(clean_runtime):
    cpu_runtime.enable()
    clip = importlib.import_module("megatron.core.optimizer.optimizer").clip_grad_by_total_norm_fp32
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)
    clip([p], max_norm=1.0, total_norm=6.0)
    assert torch.allclose(p.grad, torch.full((4,), 3.0 / (6.0 + 1e-6)))
    clip([p], max_norm=10.0, total_norm=1.0)  # under the limit: untouched
    assert torch.allclose(p.grad, torch.full((4,), 3.0 / (6.0 + 1e-6)))
