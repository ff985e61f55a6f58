"""Run Megatron-Core's MoE training path on CPU with gloo.

Megatron-Core hard-codes CUDA (device='cuda', torch.cuda.current_device(), CUDA streams/events,
the CUDA RNG). ``enable()`` makes the listed Megatron modules see a CPU stand-in for ``torch``:
only those modules, only their module-global name ``torch``, and nothing at all when CUDA is
available. No Megatron function body is copied or rewritten; a few functions are replaced or wrapped
(see ``_FUNCTION_PATCHES``) because their logic, not just their device, is CUDA-specific: the CPU
tensor type names the optimizers test for, the GPU-architecture query of argument validation, the
CUDA RNG state accessors, split sizes for all_to_all, and gradient clipping's CUDA type assertion.
One change is gloo's, not CUDA's: pipeline sends post their receives first (``recvs_first``).
One is for start-up cost only: TorchDynamo is off while the patches are active (``_EAGER``), so the
functions Megatron wraps with ``jit_fuser`` (torch.compile) run eagerly. On CPU each rank would
otherwise trace and build them again (~0.3-0.5 CPU-s per rank; tests/matrix 508 -> 417 CPU-s) for
functions this small; compiled or not, they differ only in rounding, the same on every rank.

Checked against megatron-core 0.19.2 (the version in requirements.lock); the supported range is
megatron_hybridep.megatron.compat.SUPPORTED. Each entry names the upstream functions it affects.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_hybridep.runtime.context import CpuPatches, process_context
from megatron_hybridep.runtime.logs import warn_once

log = logging.getLogger(__name__)

CHECKED_AGAINST = "0.19.2"


def _to_cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (str, int index, torch.device) to CPU; leave others alone."""
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    return device


class _NullEvent:
    """CUDA event stand-in: CPU work is synchronous, so every wait is already satisfied."""

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _NullStream:
    """CUDA stream stand-in (single in-order CPU 'stream')."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _NullEvent:
        return event or _NullEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_CURRENT_STREAM = _NullStream()


class _CudaOnCpu(types.SimpleNamespace):
    """What the patched modules see as ``torch.cuda``; anything not listed falls through."""

    Stream = _NullStream
    Event = _NullEvent

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def current_device() -> str:
        return "cpu"

    # One device per rank, the CPU: megatron.training's initialize builds the model-parallel groups
    # and seeds the RNG tracker only when it counts a device.
    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def current_stream(device: Any = None) -> _NullStream:
        return _CURRENT_STREAM

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def is_current_stream_capturing() -> bool:
        return False

    # The device RNG on CPU is torch's default (CPU) generator.
    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _cpu_factory(fn: Callable) -> Callable:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = f"{fn.__name__} with CUDA devices mapped to CPU (megatron_hybridep.cpu_runtime)."
    return wrapped


class _TorchOnCpu(types.ModuleType):
    """``torch`` as the patched Megatron modules see it: torch.cuda is _CudaOnCpu and tensor
    factories map device='cuda' to CPU. Everything else is the real torch module."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like",
                  "empty_like", "full_like", "randn", "rand", "randint", "as_tensor", "eye")

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaOnCpu()
        self.distributed = _DistributedOnGloo()
        self.device = _cpu_torch_device
        for name in self._FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def recvs_first(ops: list) -> list:
    """A batch of P2POps with its receives posted before its sends (each kind in its own order).

    gloo's TCP pair starts a message only when the receiver's "ready" notice arrives, and that notice
    travels in the same TCP stream as the data: posted after a send to the same peer, it waits behind
    that send's bytes, so Megatron's [send, recv] batches run the two directions of a pipeline
    boundary one after the other (docs/results.md, "Found: gloo runs a pipeline boundary one direction
    at a time"). Receives first lets both directions flow at once, as Megatron's schedules assume.
    Matching is per kind and peer, so the order between kinds changes nothing else."""
    recv = torch.distributed.irecv
    return [op for op in ops if op.op is recv] + [op for op in ops if op.op is not recv]


class _DistributedOnGloo(types.ModuleType):
    """``torch.distributed`` as the patched Megatron modules see it: batch_isend_irecv posts receives
    first (recvs_first); everything else is the real module."""

    def __init__(self) -> None:
        super().__init__("torch.distributed")

    @staticmethod
    def batch_isend_irecv(p2p_op_list: list) -> list:
        return torch.distributed.batch_isend_irecv(recvs_first(list(p2p_op_list)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)


class _DeviceMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, torch.device)


class _cpu_torch_device(metaclass=_DeviceMeta):  # noqa: N801 - stands in for torch.device
    """torch.device('cuda'[, i]) -> torch.device('cpu'); isinstance checks still work."""

    def __new__(cls, *args: Any, **kwargs: Any) -> torch.device:  # type: ignore[misc]
        if args and isinstance(args[0], str) and args[0].startswith("cuda"):
            return torch.device("cpu")
        return torch.device(*args, **kwargs)


# Megatron modules whose module-global ``torch`` is replaced, with the upstream functions that
# need it (megatron-core 0.19.2). A module missing in another version is reported, not fatal.
_MODULE_SHIMS: dict[str, str] = {
    "megatron.core.transformer.moe.router":
        "Router.__init__ (weight moved to torch.cuda.current_device()), "
        "TopKRouter aux-loss / load-balancing tracker buffers on the CUDA device",
    "megatron.core.transformer.moe.token_dispatcher":
        "MoEAlltoAllTokenDispatcher.__init__ (torch.cuda.Stream for D2H copies), "
        "_maybe_dtoh_and_synchronize (stream/event sync); allgather dispatcher device args",
    "megatron.core.transformer.moe.moe_layer":
        "MoELayer.setup_delayed_wgrad_for_dispatch_backward_overlap, postprocess (streams/events)",
    "megatron.core.transformer.moe.shared_experts":
        "SharedExpertMLP overlap streams (torch.cuda.Stream / stream contexts)",
    "megatron.core.transformer.moe.moe_utils":
        "maybe_move_tensor_to_cpu.record_stream, aux-loss helpers' device args",
    "megatron.core.tensor_parallel.mappings":
        "_AllToAll.forward (output buffer on torch.cuda.current_device())",
    "megatron.core.tensor_parallel.random":
        "CudaRNGStatesTracker.add / model_parallel_cuda_manual_seed (torch.cuda RNG -> CPU RNG)",
    "megatron.core.tensor_parallel.layers":
        "ColumnParallelLinear/RowParallelLinear GPU-init device args",
    "megatron.core.transformer.transformer_layer":
        "TransformerLayer router D2H event and device args",
    "megatron.core.transformer.attention": "Attention inference/rotary device args",
    "megatron.core.transformer.dot_product_attention": "DotProductAttention mask device args",
    "megatron.core.models.gpt.gpt_model": "GPTModel MTP / loss-mask device args",
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "RotaryEmbedding inv_freq device",
    "megatron.core.distributed.distributed_data_parallel":
        "DistributedDataParallel communication stream, synchronize/empty_cache",
    "megatron.core.distributed.param_and_grad_buffer":
        "_ParamAndGradBuffer allocation on torch.cuda.current_device(), bucket streams",
    "megatron.core.optimizer.optimizer":
        "FP32Optimizer._scale / MixedPrecisionOptimizer.found_inf on device='cuda'",
    "megatron.core.optimizer.distrib_optimizer":
        "DistributedOptimizer param-state buffers on torch.cuda.current_device() (save/load of its state)",
    "megatron.core.optimizer.grad_scaler": "ConstantGradScaler/DynamicGradScaler tensors on 'cuda'",
    "megatron.core.optimizer.clip_grads":
        "get_grad_norm_fp32 / clip_grad_by_total_norm_fp32 / count_zeros_fp32 buffers on 'cuda'",
    "megatron.core.transformer.moe.experts": "SequentialMLP / GroupedMLP device args",
    "megatron.core.utils": "GlobalMemoryBuffer.get_tensor (buffer on torch.cuda.current_device())",
    "megatron.core.dist_checkpointing.strategies.filesystem_async":
        "FileSystemWriterAsync.preload_tensors (torch.cuda.synchronize)",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver":
        "save_state_dict_async_finalize / verify_global_md_reuse flags on device='cuda'",
    "megatron.core.dist_checkpointing.strategies.async_utils":
        "AsyncCallsQueue liveness/finalize flags on torch.cuda.current_device(), synchronize",
    "megatron.core.transformer.utils": "get_default_causal_mask (mask built on device=\"cuda\")",
    "megatron.core.pipeline_parallel.p2p_communication":
        "P2PCommunicator._communicate (receive buffers on torch.cuda.current_device(), torch.cuda.synchronize); "
        "_batched_p2p_ops (batch_isend_irecv posts receives first: recvs_first)",
    "megatron.core.pipeline_parallel.schedules":
        "forward_backward_* total_num_tokens on device='cuda', autocast('cuda')",
}


def _cpu_maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """Replaces moe_utils.maybe_move_tensor_to_cpu: upstream converts split sizes to numpy only for
    CUDA tensors, so on CPU all_to_all would get tensors as split sizes (gloo rejects them)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


class _CpuRNGStatesTracker:
    """Mixin over Megatron's CudaRNGStatesTracker: on CPU the tracked generator *is* the CPU
    generator, so the upstream 'CPU RNG state changed within GPU RNG context' check in fork()
    would fire on every forked region. Same states, same semantics, no false warning."""

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):  # noqa: ANN201 - context manager
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        orig_state = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig_state = self.states_[orig_name]
            torch.set_rng_state(orig_state)
            self._current_state_name = orig_name


def _cpu_get_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_cuda_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_clip_grad_by_total_norm(orig: Callable) -> Callable:
    """Wraps optimizer.clip_grads.clip_grad_by_total_norm_fp32, which asserts grads are
    'torch.cuda.FloatTensor'. Same rule: scale every grad by min(1, max_norm / (norm + 1e-6))."""

    def clip(parameters: Any, max_norm: float, total_norm: Any, use_decoupled_grad: bool = False) -> None:
        params = [parameters] if torch.is_tensor(parameters) else list(parameters)
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr) for p in params if getattr(p, attr, None) is not None]
        if any(g.is_cuda for g in grads):
            return orig(parameters, max_norm, total_norm, use_decoupled_grad)
        coeff = max_norm / (total_norm + 1.0e-6)
        if torch.is_tensor(coeff):
            coeff = coeff.clamp_max(1.0)
        elif coeff >= 1.0:
            return None
        for g in grads:
            g.detach().mul_(coeff)
        return None

    return clip


# Parameter types as the optimizers' type tests expect them: Float16OptimizerWithFloat16Params and
# DistributedOptimizer sort parameters by ``param.type()`` into 'torch.cuda.{Half,BFloat16}Tensor'
# (fp32 main copy made) and 'torch.cuda.FloatTensor' (the param is its own main param), and raise
# TypeError for anything else, CPU tensors included. float64 (--hybridep-fp64, exactness tests)
# takes the full-precision path: like fp32, it is its own main param.
_CUDA_TYPE_NAMES = {torch.float16: "torch.cuda.HalfTensor", torch.bfloat16: "torch.cuda.BFloat16Tensor",
                    torch.float32: "torch.cuda.FloatTensor", torch.float64: "torch.cuda.FloatTensor"}


@contextlib.contextmanager
def _cuda_type_names() -> Any:
    """While active, ``t.type()`` (no argument) of a CPU float tensor returns the CUDA name above.
    torch.Tensor.type is a class attribute, so this is process-wide for the duration: it is held
    only around the optimizers' constructors (see _cpu_typed_init), which run before any thread."""
    original = torch.Tensor.type

    def type_name(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_name
    try:
        yield
    finally:
        torch.Tensor.type = original


def _cpu_typed_init(orig: Callable) -> Callable:
    """Wraps an optimizer ``__init__`` whose parameter sorting tests ``param.type()`` for CUDA names."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - replaces __init__
        with _cuda_type_names():
            orig(self, *args, **kwargs)

    __init__.__wrapped__ = orig
    return __init__


def _cpu_device_arch_version(orig: Callable) -> Callable:
    """Replaces get_device_arch_version (torch.cuda.get_device_properties('cuda:0').major) in
    argument validation, which calls it for TP/CP > 1 and initialises CUDA (fatal in a forked rank).
    A CPU has no CUDA_DEVICE_MAX_CONNECTIONS hardware-queue ordering to require, which is what the
    'Blackwell or later' answer (10) means to validate_args."""

    def arch() -> int:
        return 10

    return arch


def _cpu_gather_uneven(orig: Callable) -> Callable:
    """Wraps mappings._gather_along_first_dim. With output_split_sizes (the alltoall dispatcher's
    TP gather of routed tokens under sequence parallelism) upstream calls all_gather with a list of
    unequal tensors, which NCCL accepts and gloo rejects ('invalid tensor size'). Same result on
    CPU: pad every rank's rows to the largest split, gather equal blocks, drop the padding."""

    def gather(input_: torch.Tensor, group: Any, output_split_sizes: Any = None,
               use_global_buffer: bool = False) -> torch.Tensor:
        if output_split_sizes is None or input_.is_cuda or group.size() == 1:
            return orig(input_, group, output_split_sizes, use_global_buffer)
        width = max(output_split_sizes)
        padded = input_.new_zeros((width, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        blocks = orig(padded, group).split(width)
        return torch.cat([block[:n] for block, n in zip(blocks, output_split_sizes, strict=True)])

    return gather


def _cpu_reduce_scatter_uneven(orig: Callable) -> Callable:
    """Wraps mappings._reduce_scatter_along_first_dim. With input_split_sizes (the dispatcher's
    combine under sequence parallelism) upstream calls the list reduce_scatter, which gloo lacks.
    Same result on CPU: pad each split to the largest with zeros, reduce-scatter equal blocks,
    keep this rank's rows."""

    def reduce_scatter(input_: torch.Tensor, group: Any, input_split_sizes: Any = None,
                       use_global_buffer: bool = False) -> torch.Tensor:
        if input_split_sizes is None or input_.is_cuda or group.size() == 1:
            return orig(input_, group, input_split_sizes, use_global_buffer)
        width = max(input_split_sizes)
        padded = input_.new_zeros((group.size() * width, *input_.shape[1:]))
        for i, part in enumerate(input_.split(list(input_split_sizes))):
            padded[i * width: i * width + part.shape[0]] = part
        return orig(padded, group)[: input_split_sizes[group.rank()]]

    return reduce_scatter


def _cpu_fp64_main_grads(orig: Callable) -> Callable:
    """Wraps DistributedOptimizer._copy_model_grads_to_main_grads, which hands each shard its
    gradient as ``grad.float()``. float64 parameters (--hybridep-fp64, CPU exactness checks) are
    their own main params (see _CUDA_TYPE_NAMES), and torch refuses a float32 grad on a float64
    tensor; for those shards the same slice of main_grad is assigned in float64. Any other dtype
    goes through upstream unchanged."""

    def copy(self: Any) -> None:
        shards = [s for group in self.shard_fp32_groups for s in group]
        if not any(s.dtype == torch.float64 for s in shards):
            return orig(self)
        orig_float = torch.Tensor.float
        # upstream's only cast in this method: keep float64 slices float64
        torch.Tensor.float = lambda t, *a, **k: t if t.dtype == torch.float64 else orig_float(t, *a, **k)
        try:
            return orig(self)
        finally:
            torch.Tensor.float = orig_float

    return copy


def _cpu_state_dict_before_first_step(orig: Callable) -> Callable:
    """Wraps DistributedOptimizer.state_dict. With torch's Adam (no Apex/TE, always the case on
    CPU) it reads 'step' from the inner optimizer's per-param state and asserts exactly one value;
    before the first step there is none, and loading a checkpoint calls state_dict() on a fresh
    optimizer to build its template (sharded_state_dict(is_loading=True)). Megatron's own
    _init_optimizer_states_with_dummy_values allocates that state first, as its FSDP load path
    does; the model, its Adam state and 'step' are then all overwritten by the checkpoint."""

    def state_dict(self: Any) -> Any:
        from megatron.core.optimizer import distrib_optimizer

        if not distrib_optimizer.HAVE_APEX_OR_TE and len(self.optimizer.state) == 0:
            self._init_optimizer_states_with_dummy_values()
        return orig(self)

    return state_dict


def _cpu_own_step_per_param(orig: Callable) -> Callable:
    """Wraps DistributedOptimizer.load_state_dict. With torch's Adam (no Apex/TE) the checkpoint's
    step lives in its param_groups (upstream asserts one value), but upstream restores it by
    putting one tensor object into every parameter's state, and the dp_reshardable load then
    copies the load template's step (the placeholder state's) over it. Every parameter gets its
    own step tensor with the checkpoint's value, as torch's Adam would hold it; torch's Adam
    increments each in place, so a shared one would also advance once per parameter."""

    def load_state_dict(self: Any, state_dict: Any) -> None:
        from megatron.core.optimizer import distrib_optimizer

        orig(self, state_dict)
        if distrib_optimizer.HAVE_APEX_OR_TE:
            return
        steps = {g["step"] for g in state_dict["optimizer"]["param_groups"]}
        assert len(steps) == 1, steps  # upstream asserts the same
        step = float(steps.pop())
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = torch.tensor(step, dtype=state["step"].dtype)

    return load_state_dict


class _NotSequenceParallel:
    """A TransformerConfig view that reads sequence_parallel as False (for WrappedTorchNorm)."""

    def __init__(self, config: Any) -> None:
        self._config = config

    sequence_parallel = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _cpu_torch_norm_new(orig: Callable) -> Callable:
    """Wraps WrappedTorchNorm.__new__, which asserts 'sequence parallel not supported by torch
    LayerNorm' (the local spec's norm without Apex, i.e. always on CPU). A norm is per-token, so it
    runs unchanged on a sequence shard; what SP needs is its weight gradients summed over the TP
    group, which finalize_model_grads does for params marked ``sequence_parallel``, the mark
    Megatron's Apex/TE norms set. Same mark here."""

    def __new__(cls: type, config: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807 - replaces __new__
        if not config.sequence_parallel:
            return orig(cls, config, *args, **kwargs)
        norm = orig(cls, _NotSequenceParallel(config), *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return staticmethod(__new__)


@dataclass(frozen=True)
class _FunctionPatch:
    module: str
    attr: str  # attribute of the module, or 'Class.method'
    replacement: Callable[[Any], Any]  # original -> replacement
    upstream: str


_FUNCTION_PATCHES: tuple[_FunctionPatch, ...] = (
    _FunctionPatch("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu",
                   lambda orig: _cpu_maybe_move_tensor_to_cpu,
                   "moe_utils.maybe_move_tensor_to_cpu as imported by token_dispatcher"),
    _FunctionPatch("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu",
                   lambda orig: _cpu_maybe_move_tensor_to_cpu, "moe_utils.maybe_move_tensor_to_cpu"),
    _FunctionPatch("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32",
                   _cpu_clip_grad_by_total_norm,
                   "optimizer.clip_grads.clip_grad_by_total_norm_fp32 as imported by optimizer"),
    _FunctionPatch("megatron.core.tensor_parallel.random", "_get_cuda_rng_state",
                   lambda orig: _cpu_get_cuda_rng_state, "tensor_parallel.random._get_cuda_rng_state"),
    _FunctionPatch("megatron.core.tensor_parallel.random", "_set_cuda_rng_state",
                   lambda orig: _cpu_set_cuda_rng_state, "tensor_parallel.random._set_cuda_rng_state"),
    _FunctionPatch("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker",
                   lambda orig: type("CpuRNGStatesTracker", (_CpuRNGStatesTracker, orig), {}),
                   "tensor_parallel.random.CudaRNGStatesTracker.fork"),
    _FunctionPatch("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__",
                   _cpu_typed_init, "Float16OptimizerWithFloat16Params.__init__ (param.type() in CUDA names)"),
    _FunctionPatch("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__",
                   _cpu_typed_init, "DistributedOptimizer.__init__ / _build_model_and_main_param_groups "
                   "(param.type() in CUDA names)"),
    _FunctionPatch("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim", _cpu_gather_uneven,
                   "tensor_parallel.mappings._gather_along_first_dim (uneven all_gather list)"),
    _FunctionPatch("megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_first_dim",
                   _cpu_reduce_scatter_uneven,
                   "tensor_parallel.mappings._reduce_scatter_along_first_dim (list reduce_scatter)"),
    _FunctionPatch("megatron.core.transformer.torch_norm", "WrappedTorchNorm.__new__", _cpu_torch_norm_new,
                   "WrappedTorchNorm.__new__ (asserts not config.sequence_parallel)"),
    _FunctionPatch("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._copy_model_grads_to_main_grads",
                   _cpu_fp64_main_grads, "DistributedOptimizer._copy_model_grads_to_main_grads (grad.float() "
                   "for float64 params)"),
    _FunctionPatch("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.state_dict",
                   _cpu_state_dict_before_first_step, "DistributedOptimizer.state_dict (torch Adam: asserts "
                   "one 'step' value, none exists before the first step; loading a checkpoint needs it)"),
    _FunctionPatch("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.load_state_dict",
                   _cpu_own_step_per_param, "DistributedOptimizer.load_state_dict (torch Adam: one 'step' "
                   "tensor shared by every parameter's state)"),
    _FunctionPatch("megatron.training.arguments", "get_device_arch_version", _cpu_device_arch_version,
                   "training.utils.common_utils.get_device_arch_version as imported by validate_args"),
)


def _module_shims() -> dict[str, str]:
    from megatron_hybridep.megatron import cpu_training

    return _MODULE_SHIMS | cpu_training.MODULE_SHIMS


def _function_patches() -> tuple[_FunctionPatch, ...]:
    from megatron_hybridep.megatron import cpu_training

    return _FUNCTION_PATCHES + tuple(_FunctionPatch(*entry) for entry in cpu_training.FUNCTION_PATCHES)


def _owner(patch: _FunctionPatch) -> tuple[Any, str]:
    """(object holding the attribute, attribute name) for a patch's 'attr' or 'Class.method'."""
    owner = importlib.import_module(patch.module)
    *path, name = patch.attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name

_EAGER = ("torch._dynamo.config", "disable")  # set True while enabled: no torch.compile on CPU ranks


def _patches() -> CpuPatches:
    return process_context().cpu_patches


def is_enabled() -> bool:
    return bool(_patches().saved)


def enable(force: bool = False) -> bool:
    """Make Megatron-Core's MoE path run on CPU. Idempotent. Returns True when patches are active.

    A no-op (returns False) when CUDA is available, unless ``force`` (tests only).
    """
    patches = _patches()
    with patches.lock:
        saved = patches.saved
        if saved:
            return True
        if torch.cuda.is_available() and not force:
            log.debug("cpu_runtime.enable(): CUDA is available, Megatron left untouched")
            return False
        from megatron_hybridep.megatron.compat import check_megatron_version

        check_megatron_version()
        shim = _TorchOnCpu()
        for name in _module_shims():
            try:
                module = importlib.import_module(name)
            except ImportError as exc:  # optional module in this megatron-core version
                warn_once(log, "cpu_runtime: %s not importable (%s); its CUDA paths stay unpatched", name, exc)
                continue
            saved.append((module, "torch", module.torch))
            module.torch = shim
        for patch in _function_patches():
            owner, name = _owner(patch)
            original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            saved.append((owner, name, original))
            setattr(owner, name, patch.replacement(original))
        dynamo_config = importlib.import_module(_EAGER[0])
        saved.append((dynamo_config, _EAGER[1], getattr(dynamo_config, _EAGER[1])))
        setattr(dynamo_config, _EAGER[1], True)
        _reset_rng_tracker()
        return True


def disable() -> None:
    """Undo enable() (tests use it to check the patches are reversible)."""
    patches = _patches()
    with patches.lock:
        while patches.saved:
            module, attr, original = patches.saved.pop()
            setattr(module, attr, original)
        _reset_rng_tracker()


def _reset_rng_tracker() -> None:
    # A tracker built before enable() holds CUDA generator states; rebuild it lazily.
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._CUDA_RNG_STATE_TRACKER = None
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def patched_modules() -> dict[str, str]:
    """Module -> upstream functions affected (for docs and the closing note)."""
    return (_module_shims() | {f"{p.module}.{p.attr}": p.upstream for p in _function_patches()}
            | {".".join(_EAGER): "megatron.core.jit.jit_fuser (torch.compile): its functions run eagerly"})
