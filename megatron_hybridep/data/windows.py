"""Training batches from an indexed dataset for benchmark loops that drive train_step themselves
(benchmarks/convergence.py): random windows over the concatenated documents, deterministic in
(seed, stream, step) like MarkovCorpus.batch, so every system sees the same text."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from megatron_hybridep.data.text import CorpusError


@dataclass
class TokenWindows:
    prefix: str
    seed: int = 0
    tokens: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not (os.path.isfile(self.prefix + ".bin") and os.path.isfile(self.prefix + ".idx")):
            raise CorpusError(f"no indexed dataset at {self.prefix!r} (.bin/.idx); prepare one with "
                              f"'scripts/prepare_corpus --out {self.prefix}' or pass --corpus FILE")
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        ds = IndexedDataset(self.prefix)
        # kept in the file's dtype (uint16 for bytes): 2 bytes a token in each rank's memory
        self.tokens = np.concatenate([np.asarray(ds[i]) for i in range(len(ds))])

    def vocab_needed(self) -> int:
        return int(self.tokens.max()) + 1

    def unigram_entropy(self) -> float:
        """Nats/token of the token frequencies: the loss of a model that learns nothing else."""
        p = np.bincount(self.tokens.astype(np.int64)) / len(self.tokens)
        p = p[p > 0]
        return float(-(p * np.log(p)).sum())

    def batch(self, batch_size: int, seq_len: int, stream: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, labels) of shape [batch, seq], labels shifted by one; windows may cross documents
        (their EOD tokens included), as in Megatron's GPTDataset."""
        if len(self.tokens) <= seq_len:
            raise CorpusError(f"{self.prefix}: {len(self.tokens)} tokens, fewer than a sequence of {seq_len} + 1")
        rng = np.random.default_rng([self.seed, stream, step])
        starts = rng.integers(0, len(self.tokens) - seq_len, batch_size)
        data = torch.from_numpy(np.stack([self.tokens[s:s + seq_len + 1] for s in starts]).astype(np.int64))
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()
