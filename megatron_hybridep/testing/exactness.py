"""Tolerances for exactness tests (HybridEP against Megatron's alltoall EP), see docs/testing.md.

Both systems compute the same sums in different orders (tokens grouped by rank, gradients of
borrowed experts added back), so they agree only up to rounding. That rounding is amplified by
the optimizer: Adam's step lr * m / (sqrt(v) + eps) turns a 1e-7 relative difference in a near-zero
gradient into a large fraction of lr. In float32 this reached 1.8e-5 after 5 steps on one CPU and
not on another. The tests therefore compare in float64, where the same amplification of a 2^-52
(not 2^-23) rounding stays below ~1e-13, and a real bug (one token's contribution lost or counted
twice, a wrong expert, a stale copy) still moves values by > 1e-6.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

# Worst float32 error seen (1.8e-5, parameters after 5 Adam steps) scaled by 2^-29 (float64 vs
# float32 unit roundoff) is 3.4e-14: 1e-10 leaves ~3000x headroom for other CPUs' summation orders
# and is still 4 orders of magnitude below the smallest bug signal (1e-6).
FP64_TOL = 1e-10

# Where a test stays in float32: tolerance = K * the oracle's own float32-vs-float64 error on the
# same inputs, its maximum over the whole model (per tensor it is too noisy: which near-zero
# gradients Adam amplifies is chance; over the model the two systems' errors agree within 1.25x,
# measured). K = 4: |hyb32 - a2a32| <= |hyb32 - a2a64| + |a2a32 - a2a64|, about 2x the oracle's error
# (same precision, same mechanism), doubled for HybridEP's different split of the sums.
K = 4.0


def scaled_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref|, relative to ref's scale where that exceeds 1 (absolute below): gradients of a
    hot expert sum many tokens (|g| ~ 15), and rounding scales with the magnitude."""
    x, ref = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(ref, dtype=torch.float64)
    return (x - ref).abs().max().item() / max(1.0, ref.abs().max().item())


def max_error(xs: Mapping[str, torch.Tensor], refs: Mapping[str, torch.Tensor]) -> float:
    """The largest scaled_error over the tensors of two same-keyed mappings."""
    assert xs.keys() == refs.keys(), (sorted(xs), sorted(refs))
    return max(scaled_error(xs[k], refs[k]) for k in refs)


def derived_tolerance(oracle_low: Mapping[str, torch.Tensor], oracle_fp64: Mapping[str, torch.Tensor]) -> float:
    """K times the oracle's own low-precision error against float64 (same inputs, same run)."""
    return K * max_error(oracle_low, oracle_fp64)
