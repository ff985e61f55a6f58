"""What the model sends: token bytes, expert bytes (exact or compressed), compute time, routing.

A Workload is a model's architecture (plan/model.py's ModelSpec, whose fields it repeats) plus the
run quantities below. Loaded through plan/model.py's load_model from configs/models/*.yaml (keys =
field names below) or a configs/presets/*.yaml. Every quantity is per rank, per MoE layer and per
micro-batch unless its name says otherwise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_hybridep.plan import wire
from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.model import ARCHITECTURE, ModelSpec, load_model, model_from_dict

BORROWED_COPIES = ("auto", "iteration", "microbatch")
BACKENDS = ("nccl", "gloo")


# Returned-gradient compression above this costs model quality (docs/compression.md, 8 seeds on real
# text over 1,200 steps: with weights at 10x, gradients 10x +0.97%, worst seed +2.2%; 4x +0.30%, worst
# +1.2%, and with bf16 values, the default, +0.21%, worst +1.4%); the runtime caps it here by default
# (--hybridep-max-grad-compression-ratio).
QUALITY_GRAD_RATIO = 4.0
# --hybridep-grad-compression-values: a compressed gradient's kept values -> Workload.grad_value_bytes
# (0: the gradient's own precision); runtime/migration.py maps the same names to dtypes
GRAD_VALUE_BYTES = {"bf16": 2, "same": 0}
# Expert weights above this ratio cost quality too (50x: worst seed +2.1% alone, +3.9% with gradients at
# 10x; weights 10x cost little on top of the gradients' share, docs/compression.md); capped by default
# (--hybridep-max-compression-ratio).
QUALITY_WEIGHT_RATIO = 10.0
# Compressed domains above this many ranks cost more quality (1 - 1/S of the tokens on compressed
# copies: weights 50x + gradients 10x, 8 seeds, +1.0% at S = 2, +2.6% at S = 4); pretrain_moe.py
# plans within it by default (--hybridep-max-compressed-domain).
QUALITY_MAX_COMPRESSED_DOMAIN = 2
# --hybridep-early-grad-return's default (auto) where it applies (compressed returns held for an
# iteration of M > 1): the first M-1 micro-batches' share leaves during the last micro-batch, the rest at
# this ratio. At 5 Mbit/s it shortened HybridEP-c's step 4.11 -> 3.81 s; at M = 8 over 8 seeds it cost what
# one return costs (+0.09 points of loss, 502 steps to the targets vs 501; docs/results.md, "The returned
# gradients in two parts, by default").
EARLY_RETURN_RATIO = 16.0


def auto_early_return(grad_ratio: float) -> float:
    """auto's rest ratio for returned gradients compressed ``grad_ratio``x: EARLY_RETURN_RATIO up to the
    quality cap (the measured case: the rest at 16x is a quarter of one return at 4x; above the cap the
    rest would be little smaller than one return, at 50x larger), else 0 (one return)."""
    return EARLY_RETURN_RATIO if 1 < grad_ratio <= QUALITY_GRAD_RATIO else 0.0

# The codec's compute per element on a CPU rank in training: py-spy on the testbed (4 ranks on 2
# cores, issue 25's expert-heavy model) puts encode at ~73 and decode at ~29 ns of a rank's wall time
# per element (an idle core: ~15-23 and 3-13, `python benchmarks/codec.py --threads 1`; docs/cost_model.md).
# On an H200 the batched Triton codec encodes a DeepSeek-V3-size layer (8 x 44M) in 7.9 ms and decodes
# in ~5 ms, and adds 2.3-2.8 ms per layer at the paper's 8.4M (docs/gpu.md, "Batched encode").
CPU_ENCODE_NS, CPU_DECODE_NS = 70.0, 30.0
GPU_ENCODE_NS, GPU_DECODE_NS = 0.025, 0.015

# Fixed cost of one collective call on gloo, 4 ranks sharing 2 cores (the testbed): waiting for the
# slowest rank and for gloo's threads to be scheduled. Priced only when asked for (collective_overhead_ms;
# docs/cost_model.md says why it is not the default). `python benchmarks/collective_call_probe.py`
# gives 1.9-2.4 ms per all-to-all between sub-ms computes and 4-23 ms between 5-20 ms ones; issue 26's
# token-heavy model unshaped, 128 all-to-alls per step, runs 0.2-0.3 s slower than the plan without
# them (1.6-2.4 ms each). On NCCL a call's cost is the links' latency_us.
GLOO_CALL_MS = 2.0

# Achieved dense TFLOP/s per rank when a model states none: an H100-class GPU, as pretrain_moe.py
# assumes on GPU (train/planning.py). Every configs/models file states its own.
DEFAULT_THROUGHPUT_TFLOPS = 300.0


@dataclass(frozen=True)
class Workload:
    hidden_size: int
    ffn_hidden_size: int                     # of one routed expert
    num_experts: int
    top_k: int
    num_moe_layers: int
    num_layers: int = 0                      # all transformer layers (0 = num_moe_layers); the rest are dense
    seq_length: int = 2048
    micro_batch_size: int = 1
    tokens_per_rank: int = 0                 # per micro-batch (0 = seq_length * micro_batch_size)
    micro_batches: int = 1                   # gradient-accumulation steps per iteration
    gated_mlp: bool = False                  # SwiGLU experts have 3 matrices, plain GELU MLPs 2
    dense_ffn_hidden_size: int = 0           # FFN of the dense layers (0 = 4 * hidden)
    shared_experts: int = 0                  # DeepSeek-style always-on experts (compute before the routed ones)
    activation_bytes: int = 2                # bytes per element of dispatched tokens (bf16)
    weight_bytes: int = 2                    # bytes per expert parameter as stored for compute
    grad_bytes: int = 2                      # bytes per borrowed-expert gradient element returned to its owner
    main_grad_bytes: int = 4                 # main-grad buffers, accumulated and all-reduced in fp32 under bf16
    #   (Megatron sets accumulate_allreduce_grads_in_fp32 with --bf16)
    optimizer_bytes_per_param: int = 12      # Adam: fp32 master + 2 moments
    distributed_optimizer: bool = False      # optimizer state and master weights sharded over the data-parallel
    #   group (dense params) / the expert data-parallel group (expert params), as Megatron's distributed optimizer
    tensor_model_parallel_size: int = 1      # TP: divides dense params (and expert params unless ETP is set)
    expert_tensor_parallel_size: int = 0     # ETP: divides expert params (0 = TP, Megatron's default)
    num_attention_heads: int = 0             # TP must divide it (0 = not stated: TP must divide hidden_size)
    pipeline_model_parallel_size: int = 1    # PP: a stage holds 1/PP of the layers; EP groups live inside a stage
    virtual_pipeline_model_parallel_size: int = 1  # model chunks per pipeline rank (> 1: the interleaved schedule)
    sequence_parallel: bool = False          # activations between stages are split over TP (each rank sends 1/TP)
    overlap_grad_reduce: bool = False        # Megatron DDP reduces gradients during the last micro-batch's backward
    overlap_param_gather: bool = False       # the distributed optimizer's parameter all-gather runs during the next
    #   iteration's first forward (needs distributed_optimizer)
    ddp_bucket_size: int | None = None       # Megatron DDP's gradient bucket, in parameters (--ddp-bucket-size;
    #   None = its default, max(40M, 1M x DP)): a bucket is reduced once all its gradients are ready
    data_parallel_size: int = 0              # dense DP (0 = world / (TP x PP)); checked against it
    vocab_size: int = 0                      # embedding rows (input + output, untied), counted as dense params
    dense_params: int | None = None          # all non-expert params (None = estimated from the shape)
    async_grad_return: bool = False          # --hybridep-async-grad-return: a layer's borrowed gradients return while
    #   the backward of the layers below it runs (the last micro-batch's, where they are returned)
    early_return_rest_ratio: float = 0.0     # --hybridep-early-grad-return: with compressed returns held for the
    #   iteration, the first M-1 micro-batches' return overlaps the last micro-batch; the rest at this ratio
    borrowed_copies: str = "auto"            # "iteration": gather borrowed experts once per step and return their
    #   gradients once; "microbatch": both in every micro-batch; "auto": iteration when its held memory fits
    backend: str = "nccl"                    # torch.distributed backend of the collectives: under gloo an exact
    #   gradient return is an all-to-all of chunks (runtime/migration.py), not a reduce-scatter ring
    throughput_tflops: float = DEFAULT_THROUGHPUT_TFLOPS  # achieved dense TFLOP/s per rank: compute times
    t_pre_ms: float | None = None            # measured compute before the experts (fwd, per MoE layer)
    compression_ratio: float = 1.0           # parameters / values kept when shipping an expert (top-k residual)
    grad_compression_ratio: float = 1.0      # the same for the gradient returned to the owner
    grad_value_bytes: int = 2                # bytes per kept value of a compressed returned gradient (the runtime
    #   sends bf16, its error feedback keeps the rounding; 0 = the gradient's own precision)
    max_compressed_domain: int = 0           # compressed: plan no domain of more ranks (0 = no cap); a domain of S
    #   ranks computes 1 - 1/S of the routed tokens on compressed copies, and the loss cost grows with it
    compressed_expert_bytes: float | None = None  # bytes per shipped expert from a real codec (wins over ratio)
    compressed_grad_bytes: float | None = None    # bytes per returned expert gradient from a real codec
    codec_encode_ns: float | None = None     # codec compute per element encoded / decoded on a rank (None: by
    codec_decode_ns: float | None = None     #   backend: gloo CPU_*_NS, nccl GPU_*_NS)
    collective_overhead_ms: float = 0.0      # fixed cost of each collective call beyond its links (0: not
    #   priced; the testbed's gloo ranks: GLOO_CALL_MS)
    shared_sync_bytes_per_layer: float = 0.0  # bytes per MoE layer per iteration all-reduced over the EP group
    #   to refresh the shared expert (runtime SharedExpertRule.sync_bytes_per_step; 0 = frozen after init)
    routing_counts: Any = None               # tokens rank -> expert: (G, E) or (moe_layers, G, E) array
    name: str = ""
    description: str = ""

    def __post_init__(self) -> None:
        def need(cond: bool, fld: str, msg: str, fix: str) -> None:
            if not cond:
                raise PlanError(f"model.{fld}: {msg} (got {getattr(self, fld)!r}); fix: {fix}")

        self.model  # noqa: B018 - the architecture's checks (plan/model.py)
        for fld in ("num_moe_layers", "micro_batch_size", "micro_batches", "activation_bytes", "weight_bytes",
                    "grad_bytes", "main_grad_bytes", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                    "virtual_pipeline_model_parallel_size"):
            v = getattr(self, fld)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, fld, "must be a positive integer",
                 "set it from the model config")
        for fld in ("tokens_per_rank", "optimizer_bytes_per_param", "data_parallel_size",
                    "expert_tensor_parallel_size"):
            v = getattr(self, fld)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 0, fld, "must be an integer >= 0",
                 "set it from the model config")
        need(self.ddp_bucket_size is None or (isinstance(self.ddp_bucket_size, int) and self.ddp_bucket_size > 0),
             "ddp_bucket_size", "must be a positive integer (parameters per bucket)", "leave it out for Megatron's "
             "default")
        need(self.dense_params is None or (isinstance(self.dense_params, int) and self.dense_params >= 0),
             "dense_params", "must be an integer >= 0", "count the non-expert parameters, or leave it out")
        need(self.borrowed_copies in BORROWED_COPIES, "borrowed_copies",
             f"must be one of {', '.join(BORROWED_COPIES)}", "use auto unless forcing a mode")
        need(self.backend in BACKENDS, "backend", f"must be one of {', '.join(BACKENDS)}",
             "use nccl on GPUs, gloo on CPU ranks")
        need(self.pipeline_model_parallel_size <= self.layers, "pipeline_model_parallel_size",
             f"cannot exceed the {self.layers} layers", "use fewer pipeline stages")
        chunks = self.pipeline_model_parallel_size * self.virtual_pipeline_model_parallel_size
        need(self.virtual_pipeline_model_parallel_size == 1 or (self.pipeline_model_parallel_size > 1
                                                                and chunks <= self.layers),
             "virtual_pipeline_model_parallel_size", f"needs PP > 1 and PP x v <= the {self.layers} layers",
             "use 1 (the 1F1B schedule) or fewer virtual stages")
        need(self.virtual_pipeline_model_parallel_size == 1 or self.micro_batches >= self.pipeline_model_parallel_size,
             "micro_batches", "the interleaved schedule needs at least PP micro-batches (Megatron's rule)",
             "raise micro_batches or use the 1F1B schedule")
        need(not self.overlap_param_gather or self.distributed_optimizer, "overlap_param_gather",
             "needs distributed_optimizer (Megatron's rule)", "set distributed_optimizer or drop it")
        need(self.throughput_tflops > 0, "throughput_tflops", "must be > 0",
             "give the achieved TFLOP/s per rank, or measure t_pre_ms")
        need(self.t_pre_ms is None or self.t_pre_ms >= 0, "t_pre_ms", "must be >= 0", "give a measured time")
        for fld in ("compression_ratio", "grad_compression_ratio"):
            need(getattr(self, fld) >= 1, fld, "must be >= 1 (1 = exact, 50 = keep 2% of the values)",
                 "use 1 for no compression")
        need(self.early_return_rest_ratio == 0 or self.early_return_rest_ratio >= 1, "early_return_rest_ratio",
             f"must be 0 (off) or >= 1, got {self.early_return_rest_ratio}", "--hybridep-early-grad-return 0 or >= 1")
        need(self.grad_value_bytes in (0, 2, 4), "grad_value_bytes", f"must be 0, 2 or 4, got {self.grad_value_bytes}",
             "2 (bf16 values, the runtime's default) or 0 (the gradient's own precision)")
        need(self.max_compressed_domain >= 0, "max_compressed_domain", "must be >= 0 (0 = no cap)",
             "give the largest domain, in ranks, that may run on compressed copies")
        for fld in ("compressed_expert_bytes", "compressed_grad_bytes"):
            need(getattr(self, fld) is None or getattr(self, fld) > 0, fld, "must be > 0",
                 "give the codec's bytes per expert, or leave it out")
        for fld in ("codec_encode_ns", "codec_decode_ns"):
            need(getattr(self, fld) is None or getattr(self, fld) >= 0, fld, "must be >= 0 (nanoseconds per element)",
                 "leave it out for the backend's default")
        need(self.collective_overhead_ms >= 0, "collective_overhead_ms", "must be >= 0 (milliseconds per call)",
             f"0 (not priced) or the measured cost, e.g. {GLOO_CALL_MS} on the testbed's gloo ranks")
        need(self.shared_sync_bytes_per_layer >= 0,
             "shared_sync_bytes_per_layer", "must be >= 0", "0 when the shared expert needs no communication")
        if self.routing_counts is not None:
            object.__setattr__(self, "routing_counts", self._check_routing(self.routing_counts))

    def _check_routing(self, counts: Any) -> np.ndarray:
        if isinstance(counts, str):
            counts = load_routing_counts(counts)
        a = np.asarray(counts, dtype=np.float64)
        if a.ndim not in (2, 3) or a.shape[-1] != self.num_experts:
            raise PlanError(f"model.routing_counts: shape {a.shape}, expected (ep_size, {self.num_experts}) or "
                            f"(num_moe_layers, ep_size, {self.num_experts}); fix: one row per EP rank, one "
                            "column per expert")
        if a.ndim == 3 and a.shape[0] != self.num_moe_layers:
            raise PlanError(f"model.routing_counts: {a.shape[0]} layers, model has {self.num_moe_layers} MoE "
                            "layers; fix: give one matrix per MoE layer or a single (ep_size, E) matrix")
        if not np.all(np.isfinite(a)) or np.any(a < 0):
            raise PlanError("model.routing_counts: entries must be finite and >= 0; fix: token counts only")
        a.setflags(write=False)
        return a

    # ---- derived sizes -------------------------------------------------------------------------------
    @property
    def model(self) -> ModelSpec:
        """The architecture alone (num_layers, num_moe_layers and dense_ffn_hidden_size resolved)."""
        return ModelSpec(**{k: getattr(self, k) for k in ARCHITECTURE})

    @property
    def tokens(self) -> int:
        """Tokens per rank per micro-batch."""
        return self.tokens_per_rank or self.seq_length * self.micro_batch_size

    @property
    def pipeline_send_bytes(self) -> float:
        """Bytes one rank sends to the next pipeline stage per micro-batch (and receives back as the
        gradient): the hidden states of its micro-batch, split over TP under sequence parallelism."""
        tp = self.tensor_model_parallel_size if self.sequence_parallel else 1
        return self.tokens * self.hidden_size * self.activation_bytes / tp

    @property
    def etp(self) -> int:
        """Expert tensor parallelism: expert_tensor_parallel_size, or TP when it is 0 (Megatron's default)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def layers(self) -> int:
        return self.num_layers or self.num_moe_layers

    @property
    def stage_moe_layers(self) -> int:
        """MoE layers on the busiest pipeline stage (all of them without PP)."""
        return -(-self.num_moe_layers // self.pipeline_model_parallel_size)

    @property
    def model_dense_params(self) -> int:
        """Non-expert parameters of the whole model: ``dense_params`` when given, else attention (QKV +
        projection, counted as MHA) and two norms per layer, the router and shared experts of every MoE
        layer, the dense layers' FFN, and untied input/output embeddings of ``vocab_size`` rows."""
        if self.dense_params is not None:
            return self.dense_params
        h = self.hidden_size
        mats = 3 if self.gated_mlp else 2
        per_layer = 4 * h * h + 2 * h
        moe = h * self.num_experts + self.shared_experts * self.expert_params
        dense_ffn = mats * h * (self.dense_ffn_hidden_size or 4 * h)
        return (self.layers * per_layer + self.num_moe_layers * moe
                + (self.layers - self.num_moe_layers) * dense_ffn + 2 * self.vocab_size * h + h)

    @property
    def expert_params(self) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.ffn_hidden_size

    @property
    def expert_bytes(self) -> float:
        """One expert's weights as stored for compute."""
        return float(self.expert_params * self.weight_bytes)

    @property
    def expert_wire_bytes(self) -> float:
        """Bytes to ship one expert: exact, or the codec's payload (kept values + their block-local
        indices + per-block counts + alignment: indices cost bytes too)."""
        if self.compressed_expert_bytes is not None:
            return float(self.compressed_expert_bytes)
        return float(codec_payload_bytes(self.expert_params, self.compression_ratio, self.weight_bytes))

    def _grad_payload(self, own_bytes: int) -> float:
        """One borrowed expert's returned gradient, held at ``own_bytes`` per element: dense, or the
        error-feedback top-k payload with values at ``grad_value_bytes`` (--hybridep-grad-compression-values)."""
        lay = wire.choose_layout(self.expert_params, self.grad_compression_ratio, self.grad_value_bytes or own_bytes)
        if lay.dense:  # sent as the gradient itself (runtime ErrorFeedbackTopK.layout)
            return float(codec_payload_bytes(self.expert_params, 1.0, own_bytes))
        return float(lay.nbytes)

    @property
    def grad_wire_bytes(self) -> float:
        """Bytes to return one borrowed expert's gradient to its owner (error-feedback top-k payload)."""
        if self.compressed_grad_bytes is not None:
            return float(self.compressed_grad_bytes)
        return self._grad_payload(self.grad_bytes)

    def returned_grad_bytes(self, mode: str) -> float:
        """Bytes to return one borrowed expert's gradient in a borrowed-copies mode: "microbatch"
        returns the copy's gradient as computed (``grad_wire_bytes``); "iteration" returns the
        accumulator over the micro-batches, kept at main-grad precision (``main_grad_bytes``; runtime
        borrowed.py), through the same codec (one micro-batch: nothing accumulates)."""
        if mode != "iteration" or self.micro_batches == 1 or self.main_grad_bytes == self.grad_bytes:
            return self.grad_wire_bytes
        if self.compressed_grad_bytes is not None:
            return float(self.compressed_grad_bytes) * self.main_grad_bytes / self.grad_bytes
        return self._grad_payload(self.main_grad_bytes)

    def splits_grad_return(self, mode: str) -> bool:
        """--hybridep-early-grad-return applies: compressed returns held for an iteration of M > 1."""
        return bool(self.early_return_rest_ratio) and self.grad_compression_ratio > 1 and mode == "iteration" \
            and self.micro_batches > 1

    def rest_grad_bytes(self, mode: str) -> float:
        """Bytes of the last backward's return of one borrowed expert when the return is split."""
        return self.replace(grad_compression_ratio=self.early_return_rest_ratio,
                            compressed_grad_bytes=None).returned_grad_bytes(mode)

    @property
    def shared_sync_bytes(self) -> float:
        """Bytes per MoE layer per iteration all-reduced over the EP group to refresh the shared expert
        of shared+residual compression (the runtime's SharedExpertRule: one dense expert every
        refresh_every steps, averaged; 0 when it is frozen after init, the default)."""
        return float(self.shared_sync_bytes_per_layer)

    @property
    def token_bytes(self) -> float:
        return float(self.hidden_size * self.activation_bytes)

    @property
    def dispatch_bytes(self) -> float:
        """D: bytes one rank dispatches per all-to-all (one copy per selected expert), balanced routing."""
        return self.tokens * self.top_k * self.token_bytes

    @property
    def flops_per_second(self) -> float:
        return self.throughput_tflops * 1e12

    @property
    def expert_flops_per_token(self) -> float:
        """Forward FLOPs of one routed-token copy through one expert."""
        return 2.0 * self.expert_params

    @property
    def pre_flops_per_token(self) -> float:
        """Forward FLOPs per token before the experts, per MoE layer: attention (projections + scores),
        router, shared experts, and the dense layers spread over the MoE layers."""
        h, s = self.hidden_size, self.seq_length
        attention = 8.0 * h * h + 4.0 * s * h
        dense_ffn = self.dense_ffn_hidden_size or 4 * h
        mats = 3 if self.gated_mlp else 2
        dense = (self.layers - self.num_moe_layers) * (attention + 2.0 * mats * h * dense_ffn)
        per_moe = attention + 2.0 * h * self.num_experts + self.shared_experts * 2.0 * self.expert_params
        return per_moe + dense / self.num_moe_layers

    @property
    def t_pre(self) -> float:
        """Seconds of compute before the experts (forward, one MoE layer, one micro-batch)."""
        if self.t_pre_ms is not None:
            return self.t_pre_ms * 1e-3
        return self.tokens * self.pre_flops_per_token / self.flops_per_second

    @property
    def expert_seconds_per_token(self) -> float:
        """Forward seconds for one token copy through one expert."""
        return self.expert_flops_per_token / self.flops_per_second

    def routing_for(self, ep_size: int) -> np.ndarray | None:
        """Routing counts as (moe_layers or 1, G, E), checked against the EP size; None when balanced."""
        if self.routing_counts is None:
            return None
        a = self.routing_counts
        if a.shape[-2] != ep_size:
            raise PlanError(f"model.routing_counts: {a.shape[-2]} rows but the EP group has {ep_size} ranks; "
                            f"fix: record counts with this EP size or pass --ep-size {a.shape[-2]}")
        return a if a.ndim == 3 else a[None]

    def codec_seconds(self, encoded: float, decoded: float) -> float:
        """A rank's codec compute for ``encoded`` and ``decoded`` elements (not overlapped: on CPU
        ranks it runs on the cores the training shares, on a GPU in the training's stream)."""
        gloo = self.backend == "gloo"
        enc = self.codec_encode_ns if self.codec_encode_ns is not None else (CPU_ENCODE_NS if gloo else GPU_ENCODE_NS)
        dec = self.codec_decode_ns if self.codec_decode_ns is not None else (CPU_DECODE_NS if gloo else GPU_DECODE_NS)
        return (encoded * enc + decoded * dec) * 1e-9

    @property
    def call_seconds(self) -> float:
        """Fixed seconds of one collective call beyond its links' time: priced once per call by
        plan/network.py."""
        return self.collective_overhead_ms * 1e-3

    def exact(self) -> Workload:
        """The same run with exact migration (no codec)."""
        return self.replace(compression_ratio=1.0, grad_compression_ratio=1.0, compressed_expert_bytes=None,
                            compressed_grad_bytes=None, early_return_rest_ratio=0.0)

    @property
    def compresses(self) -> bool:
        """Borrowed copies or their returned gradients travel compressed (a cost in model quality)."""
        return self.compression_ratio > 1 or self.grad_compression_ratio > 1

    def replace(self, **changes: Any) -> Workload:
        return dataclasses.replace(self, **changes)

    # ---- loading -------------------------------------------------------------------------------------
    @classmethod
    def from_model(cls, spec: ModelSpec, source: str = "model", **run: Any) -> Workload:
        """``spec`` run with ``run`` (Workload field names other than the architecture's); errors
        name ``source``."""
        try:
            return cls(**spec.fields(), **run)
        except TypeError:  # a value of the wrong type reached a check
            wrong = [f.name for f in dataclasses.fields(cls) if f.name in run and ("int" in str(f.type) or
                     "float" in str(f.type)) and not _is_number(run[f.name]) and run[f.name] is not None]
            if not wrong:
                raise
            raise PlanError(f"{source}.{wrong[0]}: expected a number, got {run[wrong[0]]!r}; fix: see "
                            "configs/models/ for examples") from None
        except PlanError as exc:
            raise PlanError(str(exc).replace("model.", f"{source}: ", 1)) from None

    @classmethod
    def from_dict(cls, data: Any, source: str = "model") -> Workload:
        spec, run = model_from_dict(data, source, RUN_FIELDS)
        return cls.from_model(spec, source, **run)

    @classmethod
    def from_yaml(cls, path: str) -> Workload:
        """A configs/models/*.yaml or a configs/presets/*.yaml (plan/model.py's load_model)."""
        spec, run = load_model(path, RUN_FIELDS)
        return cls.from_model(spec, path, **run)


RUN_FIELDS = tuple(f.name for f in dataclasses.fields(Workload) if f.name not in ARCHITECTURE)


def codec_payload_bytes(numel: int, ratio: float, value_bytes: int) -> int:
    """Bytes on the wire for one tensor under the project's codec at an element ratio: the wire
    format's own count (plan/wire.py), which the runtime codec lays its payloads out with."""
    return wire.payload_bytes(numel, ratio, value_bytes)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def load_routing_counts(path: str) -> np.ndarray:
    """A routing-count matrix from .npy or .csv/.txt (rows = EP ranks, columns = experts)."""
    try:
        if path.endswith(".npy"):
            return np.load(path)
        return np.loadtxt(path, delimiter="," if path.endswith(".csv") else None, ndmin=2)
    except FileNotFoundError:
        raise PlanError(f"routing_counts: {path} not found; fix: pass an existing .npy or .csv file") from None
    except ValueError as exc:
        raise PlanError(f"routing_counts: cannot read {path} ({exc}); fix: numbers only, one row per rank") from None


def zipf_routing(ep_size: int, num_experts: int, tokens: int, top_k: int, alpha: float,
                 seed: int = 0) -> np.ndarray:
    """Expected routing counts (G, E) with Zipf(alpha) expert popularity shared by all ranks.

    A token picks top_k distinct experts, so no expert can receive more than ``tokens`` copies from a
    rank: popularity above that cap is poured into the next experts (water-filling). alpha = 0 is
    balanced routing."""
    if alpha < 0:
        raise PlanError(f"skew: alpha must be >= 0, got {alpha}; fix: 0 = balanced, 1-2 = strongly skewed")
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, num_experts + 1) ** alpha
    weights = weights[rng.permutation(num_experts)]
    total = float(tokens * top_k)
    counts = np.zeros(num_experts)
    free = np.ones(num_experts, dtype=bool)
    remaining = total
    while remaining > 1e-9 * total and free.any():
        share = remaining * weights * free / (weights * free).sum()
        new = np.minimum(counts + share, tokens)
        remaining -= (new - counts).sum()
        counts = new
        free &= counts < tokens - 1e-12
    return np.tile(counts, (ep_size, 1))
