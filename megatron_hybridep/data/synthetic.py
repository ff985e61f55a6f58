"""A synthetic corpus that a small model can actually learn.

Tokens follow a sparse first-order Markov chain: every token has ``branching`` likely successors.
The unigram entropy is close to log(vocab) while the conditional entropy is about
log(branching), so a model that learns the transitions drives the loss far below the unigram
entropy; a loss that only falls to the unigram entropy means nothing but frequencies was learned.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch


@functools.cache
def _transitions(vocab_size: int, branching: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    succ = np.stack([rng.choice(vocab_size, branching, replace=False) for _ in range(vocab_size)])
    probs = rng.dirichlet(np.full(branching, 2.0), size=vocab_size)
    return succ, probs


@dataclass(frozen=True)
class MarkovCorpus:
    vocab_size: int = 256
    branching: int = 4
    seed: int = 0

    def transitions(self) -> tuple[np.ndarray, np.ndarray]:
        """(successors [V, b], probabilities [V, b]) of the chain."""
        return _transitions(self.vocab_size, self.branching, self.seed)

    def stationary(self) -> np.ndarray:
        succ, probs = self.transitions()
        p = np.zeros((self.vocab_size, self.vocab_size))
        np.add.at(p, (np.repeat(np.arange(self.vocab_size), self.branching), succ.ravel()), probs.ravel())
        pi = np.full(self.vocab_size, 1.0 / self.vocab_size)
        for _ in range(500):  # power iteration; the chain mixes fast
            pi = pi @ p
        return pi / pi.sum()

    def unigram_entropy(self) -> float:
        pi = self.stationary()
        pi = pi[pi > 0]
        return float(-(pi * np.log(pi)).sum())

    def conditional_entropy(self) -> float:
        """The best achievable loss (nats/token) for a model that knows the chain."""
        _, probs = self.transitions()
        per_token = -(probs * np.log(probs)).sum(axis=1)
        return float((self.stationary() * per_token).sum())

    def batch(self, batch_size: int, seq_len: int, stream: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, labels) of shape [batch, seq]; deterministic in (seed, stream, step) so runs
        resume exactly and each data-parallel stream sees different text."""
        succ, probs = self.transitions()
        rng = np.random.default_rng([self.seed, stream, step])
        cum = probs.cumsum(axis=1)
        seq = np.empty((batch_size, seq_len + 1), dtype=np.int64)
        seq[:, 0] = rng.integers(0, self.vocab_size, batch_size)
        u = rng.random((batch_size, seq_len))
        for t in range(seq_len):
            prev = seq[:, t]
            choice = (u[:, t, None] > cum[prev]).sum(axis=1).clip(max=self.branching - 1)
            seq[:, t + 1] = succ[prev, choice]
        data = torch.from_numpy(seq)
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()
