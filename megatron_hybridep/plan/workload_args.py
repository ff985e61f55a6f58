"""The workload flags `hybridep plan` and `hybridep simulate` share: defined and read once here."""

from __future__ import annotations

import argparse
from typing import Any

from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.workload import (
    BORROWED_COPIES,
    EARLY_RETURN_RATIO,
    QUALITY_GRAD_RATIO,
    Workload,
    load_routing_counts,
    zipf_routing,
)

# flag dest -> Workload field (flags a command did not add are skipped)
FIELDS = {
    "tokens_per_rank": "tokens_per_rank", "micro_batches": "micro_batches", "top_k": "top_k",
    "compression_ratio": "compression_ratio", "grad_compression_ratio": "grad_compression_ratio",
    "expert_bytes": "compressed_expert_bytes", "grad_bytes": "compressed_grad_bytes", "t_pre_ms": "t_pre_ms",
    "shared_sync_bytes": "shared_sync_bytes_per_layer", "throughput_tflops": "throughput_tflops",
    "borrowed_copies": "borrowed_copies", "pipeline_model_parallel_size": "pipeline_model_parallel_size",
    "tensor_model_parallel_size": "tensor_model_parallel_size", "distributed_optimizer": "distributed_optimizer",
    "num_virtual_stages_per_pipeline_rank": "virtual_pipeline_model_parallel_size",
    "sequence_parallel": "sequence_parallel", "overlap_grad_reduce": "overlap_grad_reduce",
    "overlap_param_gather": "overlap_param_gather", "ddp_bucket_size": "ddp_bucket_size",
    "max_compressed_domain": "max_compressed_domain", "early_grad_return": "early_return_rest_ratio",
    "codec_encode_ns": "codec_encode_ns", "codec_decode_ns": "codec_decode_ns",
    "collective_overhead_ms": "collective_overhead_ms", "backend": "backend",
}


def add_workload_arguments(parser: argparse.ArgumentParser, *, parallelism: bool = False,
                           grad_bytes: bool = False) -> None:
    """'what the model sends'; ``parallelism``: also the memory-relevant Megatron layout (PP, TP,
    distributed optimizer, borrowed-copies mode); ``grad_bytes``: a codec's returned-gradient size."""
    what = parser.add_argument_group("what the model sends")
    what.add_argument("--model", metavar="M.yaml", help="model YAML (configs/models/); required")
    what.add_argument("--tokens-per-rank", type=int, metavar="N", help="tokens per rank per micro-batch")
    what.add_argument("--micro-batches", type=int, metavar="N", help="gradient-accumulation steps per iteration")
    what.add_argument("--top-k", type=int, metavar="K", help="experts per token")
    what.add_argument("--compression-ratio", type=float, metavar="R",
                      help="ship experts as shared + top-k residual keeping 1/R of the values (indices counted)")
    what.add_argument("--grad-compression-ratio", type=float, metavar="R",
                      help="the same for the gradients returned to expert owners")
    what.add_argument("--early-grad-return", type=float, metavar="R",
                      help="price pretrain_moe.py's --hybridep-early-grad-return R: the first M-1 micro-batches' "
                           "returned gradients cross during the last micro-batch, the rest at ratio R (plan's "
                           f"default: pretrain_moe.py's auto, {EARLY_RETURN_RATIO:g} for returned gradients compressed "
                           f"at most {QUALITY_GRAD_RATIO:g}x; 0 = one return)")
    what.add_argument("--max-compressed-domain", type=int, metavar="S",
                      help="with compression, no domain of more than S ranks (0 = no cap): a domain of S ranks "
                           "computes 1 - 1/S of the routed tokens on compressed copies (pretrain_moe.py's "
                           "--hybridep-max-compressed-domain)")
    what.add_argument("--codec-encode-ns", type=float, metavar="NS",
                      help="the codec's compute per element encoded on a rank, priced in the gather and return "
                           "(default 0.025, an H200's Triton codec; pretrain_moe.py on CPU ranks prices 70, and "
                           "--codec-decode-ns 30)")
    what.add_argument("--codec-decode-ns", type=float, metavar="NS", help="the same per element decoded")
    what.add_argument("--backend", choices=("nccl", "gloo"),
                      help="the collectives' backend (default nccl): gloo returns exact gradients by all-to-all "
                           "and prices CPU ranks' codec compute")
    what.add_argument("--collective-overhead-ms", type=float, metavar="MS",
                      help="fixed cost of one collective call beyond its links (default 0: not priced; the "
                           "testbed's gloo ranks, 4 on 2 cores, measure ~2; on nccl it is the topology's latency_us)")
    what.add_argument("--expert-bytes", type=float, metavar="BYTES",
                      help="bytes per shipped expert measured from a codec (overrides --compression-ratio)")
    if grad_bytes:
        what.add_argument("--grad-bytes", type=float, metavar="BYTES", help="bytes per returned expert gradient")
    what.add_argument("--shared-sync-bytes", type=float, metavar="BYTES",
                      help="bytes per MoE layer per iteration all-reduced over the EP group to refresh the "
                           "shared expert (the codec's SharedExpertRule.sync_bytes_per_step; default 0: frozen)")
    what.add_argument("--t-pre-ms", type=float, metavar="MS",
                      help="measured compute before the experts per MoE layer (forward), instead of the estimate")
    what.add_argument("--throughput-tflops", type=float, metavar="TF", help="achieved TFLOP/s per rank")
    if parallelism:
        what.add_argument("--borrowed-copies", choices=BORROWED_COPIES, metavar="MODE",
                          help="auto (default): keep borrowed expert copies for the iteration when they fit the "
                               "memory, else re-gather per micro-batch; iteration / microbatch force one (the "
                               "runtime's --hybridep-borrowed-copies)")
        what.add_argument("--pipeline-model-parallel-size", type=int, metavar="PP",
                          help="pipeline stages: a stage holds 1/PP of the layers and world/PP ranks")
        what.add_argument("--tensor-model-parallel-size", type=int, metavar="TP",
                          help="tensor parallelism: divides dense and expert parameters")
        what.add_argument("--distributed-optimizer", action="store_true", default=None,
                          help="shard optimizer state over the (expert) data-parallel group (Megatron's)")
        what.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, metavar="V",
                          help="model chunks per pipeline rank: the interleaved schedule (Megatron's flag)")
        what.add_argument("--sequence-parallel", action="store_true", default=None,
                          help="activations sent between pipeline stages are split over TP")
        what.add_argument("--overlap-grad-reduce", action="store_true", default=None,
                          help="price the data-parallel gradient reductions as overlapped with the last "
                               "micro-batch's backward (Megatron's flag; default: blocking)")
        what.add_argument("--overlap-param-gather", action="store_true", default=None,
                          help="price the distributed optimizer's parameter all-gather as overlapped with the "
                               "first micro-batch's forward (Megatron's flag; needs --distributed-optimizer)")
        what.add_argument("--ddp-bucket-size", type=int, metavar="PARAMS", default=None,
                          help="Megatron DDP's gradient bucket in parameters (Megatron's flag; default max(40M, "
                               "1M x DP)): under the overlap flags a bucket hides only once all its gradients "
                               "are ready, so a model in one bucket hides nothing")
    what.add_argument("--routing-counts", metavar="FILE",
                      help="tokens from each EP rank to each expert (.npy or .csv, shape (ep_size, experts))")
    what.add_argument("--skew", type=float, metavar="ALPHA",
                      help="synthetic Zipf(ALPHA) expert popularity instead of balanced routing")


def workload_from_args(args: argparse.Namespace, *, skew_ep_size: int | None = None) -> Workload:
    """The model YAML with the flags applied; ``skew_ep_size``: the EP size --skew draws routing for
    (None: --skew is applied by the caller once the EP size is known)."""
    if not args.model:
        raise PlanError("--model: required; fix: e.g. --model configs/models/paper-l.yaml")
    w = Workload.from_yaml(args.model)
    changes: dict[str, Any] = {fld: getattr(args, flag) for flag, fld in FIELDS.items()
                               if getattr(args, flag, None) is not None}
    if args.routing_counts and args.skew is not None:
        raise PlanError("--skew: cannot be combined with --routing-counts; fix: pass one of them")
    if args.routing_counts:
        changes["routing_counts"] = load_routing_counts(args.routing_counts)
    w = w.replace(**changes) if changes else w
    if args.skew is not None and skew_ep_size is not None:
        w = with_skew(w, skew_ep_size, args.skew)
    return w


def with_skew(w: Workload, ep_size: int, alpha: float) -> Workload:
    return w.replace(routing_counts=zipf_routing(ep_size, w.num_experts, w.tokens, w.top_k, alpha))
