"""Compression codecs for parameter-efficient expert migration (the paper's section 4).

Three pieces, all pure torch (no torch.distributed: communication is passed in as callbacks), each
in its own module and re-exported here:

* runtime/weight_codec.py: :class:`SharedResidualCodec` ships an expert as top-k(expert - shared)
  and rebuilds it as shared + residual; ``use_shared=False`` (or :class:`TopKCodec`) is plain
  top-k, the ablation.
* runtime/shared_expert.py: :func:`shared_expert_mean` / :class:`SharedExpertRule` define the
  shared expert and when it is refreshed.
* runtime/error_feedback.py: :class:`ErrorFeedbackTopK` compresses gradients of borrowed experts
  with error feedback.

The wire format (sizes and layout) is defined once, in plan/wire.py; the planner prices payloads
with it and the codec lays its buffers out with it.

Use in the runtime (one MoE layer, E local experts of n parameters each, domain of S ranks)
-----------------------------------------------------------------------------------------
    codec = SharedResidualCodec(50)                      # planner: codec.nbytes(n, dtype) per expert
    shared = rule.maybe_refresh(step, shared, own, E_total, reduce_sum)   # after optimizer.step()
    send = codec.encode_batch(own.view(E, n), shared)    # [E * nbytes], owners keep exact weights
    all_gather_into_tensor(recv, send, group=domain)     # recv: [S * E * nbytes]
    codec.decode_batch(recv[peer slots], shared, out=borrowed.view(E, n))   # just before compute
    # backward, borrower side:  p = ef.compress((layer, expert), grad_of_borrowed_copy)
    # owner side:               ef.decompress(p, out=owner_grad, accumulate=True)
Memory: a payload buffer of S * E * nbytes per layer in flight; the error-feedback compressor
keeps one float32 accumulator per borrowed expert (4 bytes x n).
"""

from megatron_hybridep.runtime.error_feedback import ErrorFeedbackTopK
from megatron_hybridep.runtime.shared_expert import ReduceSum, SharedExpertRule, shared_expert_mean
from megatron_hybridep.runtime.weight_codec import (
    ALIGN,
    IndexScheme,
    PayloadLayout,
    RatioOf,
    Sections,
    SharedResidualCodec,
    TopKCodec,
    decode,
    decode_into,
    encode,
    encoded_nbytes,
    k_for_ratio,
    pack,
    plan_layout,
    unpack,
)

__all__ = ["ALIGN", "ErrorFeedbackTopK", "IndexScheme", "PayloadLayout", "RatioOf", "ReduceSum", "Sections",
           "SharedExpertRule", "SharedResidualCodec", "TopKCodec", "decode", "decode_into", "encode", "encoded_nbytes",
           "k_for_ratio", "pack", "plan_layout", "shared_expert_mean", "unpack"]
