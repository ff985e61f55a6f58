"""Logs a person can read: a warning every rank would raise the same way is logged once (rank 0),
and the known-harmless warnings of a CPU run (no TransformerEngine/Apex by design, Megatron's own
deprecated calls, torch's "No CUDA runtime is found" line) are filtered in every rank process by
quiet_known_warnings() (pretrain_moe.py, each rank, and the ranks' fork server through
train/quiet_imports.py, before it imports Megatron)."""

from __future__ import annotations

import logging
import warnings
from typing import Any

# message patterns; CPU: no TE/Apex by design; the rest are Megatron's own calls, repeated on every rank
HARMLESS = (r".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*",
            r".*transformer-engine>=1\.7\.0 supports MoE experts.*",
            r"full scope is deprecated.*", r".*GPTModel IS DEPRECATED.*", r"MimoModelConfig is experimental.*",
            r".*`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated.*")


def _drop_no_cuda_runtime_line(record: logging.LogRecord) -> bool:
    # torch.utils.cpp_extension logs it when imported (Megatron imports it) wherever CUDA is not
    # available, i.e. only in CPU runs, where no CUDA is the expected state
    return not str(record.msg).startswith("No CUDA runtime is found")


def quiet_known_warnings() -> None:
    for pattern in HARMLESS:
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("torch.utils.cpp_extension").addFilter(_drop_no_cuda_runtime_line)  # a no-op if there


def warn_once(log: logging.Logger, msg: str, *args: Any) -> None:
    """A warning every rank raises identically (it follows from the same flags and plan): logged on
    rank 0, or in a process without torch.distributed; debug level on the other ranks."""
    import torch.distributed as dist

    first = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    (log.warning if first else log.debug)(msg, *args)
