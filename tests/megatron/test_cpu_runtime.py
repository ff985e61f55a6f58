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


def test_megatron_jit_fused_functions_run_eagerly_while_enabled(clean_runtime):
    from megatron.core.jit import jit_fuser
    from torch._dynamo.utils import counters

    @jit_fuser
    def fused(x):
        return torch.nn.functional.gelu(x) * 2

    x = torch.ones(4)
    cpu_runtime.enable()
    before = sum(counters["frames"].values())
    assert torch.equal(fused(x), torch.nn.functional.gelu(x) * 2)
    assert sum(counters["frames"].values()) == before  # nothing traced
    cpu_runtime.disable()
    assert torch._dynamo.config.disable is False


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
    for name in listing:  # each entry is an importable module, module.attribute or module.Class.method
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)


def test_clip_grad_on_cpu_scales_like_upstream(clean_runtime):
    cpu_runtime.enable()
    clip = importlib.import_module("megatron.core.optimizer.optimizer").clip_grad_by_total_norm_fp32
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)
    clip([p], max_norm=1.0, total_norm=6.0)
    assert torch.allclose(p.grad, torch.full((4,), 3.0 / (6.0 + 1e-6)))
    clip([p], max_norm=10.0, total_norm=1.0)  # under the limit: untouched
    assert torch.allclose(p.grad, torch.full((4,), 3.0 / (6.0 + 1e-6)))


def test_optimizer_type_names_are_cuda_names_only_inside_the_optimizer_constructors(clean_runtime):
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    original_init = optimizer.Float16OptimizerWithFloat16Params.__init__
    seen = {}

    def probe(self, *args, **kwargs):
        seen.update({dtype: torch.zeros(1, dtype=dtype).type() for dtype in
                     (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)})

    cpu_runtime.enable()
    assert optimizer.Float16OptimizerWithFloat16Params.__init__.__wrapped__ is original_init
    wrapper = cpu_runtime._cpu_typed_init(probe)
    wrapper(object())
    assert seen == {torch.float32: "torch.cuda.FloatTensor", torch.bfloat16: "torch.cuda.BFloat16Tensor",
                    torch.float16: "torch.cuda.HalfTensor", torch.float64: "torch.cuda.FloatTensor",
                    torch.int64: "torch.LongTensor"}
    assert torch.zeros(1).type() == "torch.FloatTensor"  # outside the constructor: torch's own name
    assert torch.zeros(1).type(torch.float64).dtype == torch.float64  # conversion untouched
    cpu_runtime.disable()
    assert optimizer.Float16OptimizerWithFloat16Params.__init__ is original_init


def test_torch_norm_accepts_sequence_parallel_and_marks_its_params(clean_runtime):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = type("Cfg", (), dict(sequence_parallel=True, layernorm_zero_centered_gamma=False,
                                  persist_layer_norm=False, memory_efficient_layer_norm=False,
                                  normalization="RMSNorm"))()
    with pytest.raises(AssertionError, match="sequence parallel"):
        WrappedTorchNorm(config, 8)
    cpu_runtime.enable()
    norm = WrappedTorchNorm(config, 8)
    assert isinstance(norm, torch.nn.RMSNorm)
    assert all(p.sequence_parallel for p in norm.parameters())
    config.sequence_parallel = False
    assert not hasattr(WrappedTorchNorm(config, 8).weight, "sequence_parallel")


def _uneven_collectives(ctx):
    from megatron.core.tensor_parallel import mappings

    cpu_runtime.enable()
    group = torch.distributed.new_group([0, 1])
    sizes = [3, 1]
    mine = torch.arange(sizes[ctx.rank] * 2, dtype=torch.float64).reshape(-1, 2) + 10 * ctx.rank
    gathered = mappings._gather_along_first_dim(mine, group, output_split_sizes=sizes)
    full = torch.arange(8, dtype=torch.float64).reshape(4, 2) * (ctx.rank + 1)
    scattered = mappings._reduce_scatter_along_first_dim(full, group, input_split_sizes=sizes)
    return gathered, scattered


def test_uneven_gather_and_reduce_scatter_on_gloo_match_their_definition():
    from megatron_hybridep.train.launch import run_ranks

    out = run_ranks(_uneven_collectives, 2, timeout=120)
    rows = [torch.arange(6, dtype=torch.float64).reshape(3, 2), torch.arange(2, dtype=torch.float64).reshape(1, 2) + 10]
    full = torch.arange(8, dtype=torch.float64).reshape(4, 2) * 3  # sum over ranks of full * (rank + 1)
    for rank, (gathered, scattered) in enumerate(out):
        assert torch.equal(gathered, torch.cat(rows))
        assert torch.equal(scattered, full[:3] if rank == 0 else full[3:])


def test_argument_validation_does_not_initialise_cuda(clean_runtime):
    arguments = importlib.import_module("megatron.training.arguments")
    cpu_runtime.enable()
    assert arguments.get_device_arch_version() == 10  # no CUDA_DEVICE_MAX_CONNECTIONS rule on CPU


def test_pipeline_batches_post_their_receives_first(monkeypatch, clean_runtime):
    """gloo starts a message only when the receiver's notice arrives, in the same TCP stream as the
    data: a receive posted after a send to the same peer waits behind that send's bytes."""
    from types import SimpleNamespace

    p2p = importlib.import_module("megatron.core.pipeline_parallel.p2p_communication")
    seen = []
    monkeypatch.setattr(torch.distributed, "batch_isend_irecv", lambda ops: seen.append(ops) or [])
    dist = torch.distributed
    # Megatron's _batched_p2p_ops order: send prev, recv prev, send next, recv next
    ops = [SimpleNamespace(op=fn, peer=peer) for fn, peer in
           ((dist.isend, 0), (dist.irecv, 0), (dist.isend, 2), (dist.irecv, 2))]
    p2p.torch.distributed.batch_isend_irecv(ops)
    assert seen[-1] == ops  # upstream's order without the runtime
    cpu_runtime.enable()
    p2p.torch.distributed.batch_isend_irecv(ops)
    assert seen[-1] == [ops[1], ops[3], ops[0], ops[2]]  # receives first, each kind in its order
    assert p2p.torch.distributed.get_rank is dist.get_rank  # the rest is the real module
    cpu_runtime.disable()
    assert p2p.torch.distributed.batch_isend_irecv is dist.batch_isend_irecv


def _both_directions(ctx):
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    cpu_runtime.enable()
    peer = 1 - ctx.rank
    out = torch.empty(3)
    side = dict(tensor_send_next=torch.full((3,), 10.0 + ctx.rank), tensor_recv_next=out, tensor_send_prev=None,
                tensor_recv_prev=None) if ctx.rank == 0 else \
        dict(tensor_send_prev=torch.full((3,), 10.0 + ctx.rank), tensor_recv_prev=out, tensor_send_next=None,
             tensor_recv_next=None)
    for req in p2p._batched_p2p_ops(**side, group=None, prev_pipeline_rank=peer, next_pipeline_rank=peer):
        req.wait()
    return out


def test_receives_first_exchange_both_directions_on_gloo():
    from megatron_hybridep.train.launch import run_ranks

    out = run_ranks(_both_directions, 2, timeout=120)
    assert torch.equal(out[0], torch.full((3,), 11.0)) and torch.equal(out[1], torch.full((3,), 10.0))
