"""A synthetic corpus that a small model can actually learn.

Tokens follow a sparse Markov chain of order ``order``: every context of the last ``order``
tokens has ``branching`` likely successors. The unigram entropy is close to log(vocab) while the
conditional entropy is about log(branching), so a model that learns the transitions drives the
loss far below the unigram entropy; a loss that only falls to the unigram entropy means nothing
but frequencies was learned. Order 1 is learnable by embeddings alone; order 2 needs attention
to bring the previous token over and the MLPs (the experts) to map token pairs to successors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch


@functools.cache
def _transitions(vocab_size: int, branching: int, seed: int, order: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed if order == 1 else [seed, order])
    states = vocab_size**order
    succ = np.argsort(rng.random((states, vocab_size)), axis=1)[:, :branching]  # distinct successors
    probs = rng.dirichlet(np.full(branching, 2.0), size=states)
    return succ, probs


@functools.cache
def _stationary(vocab_size: int, branching: int, seed: int, order: int) -> np.ndarray:
    """Stationary distribution over contexts (power iteration; the chain mixes fast)."""
    succ, probs = _transitions(vocab_size, branching, seed, order)
    states = vocab_size**order
    nxt = (np.arange(states)[:, None] * vocab_size + succ) % states  # context after emitting succ
    pi = np.full(states, 1.0 / states)
    for _ in range(300):
        new = np.zeros(states)
        np.add.at(new, nxt.ravel(), (pi[:, None] * probs).ravel())
        pi = new
    return pi / pi.sum()


@dataclass(frozen=True)
class MarkovCorpus:
    vocab_size: int = 256
    branching: int = 4
    seed: int = 0
    order: int = 1

    def transitions(self) -> tuple[np.ndarray, np.ndarray]:
        """(successors [V**order, b], probabilities [V**order, b]) of the chain."""
        return _transitions(self.vocab_size, self.branching, self.seed, self.order)

    def stationary(self) -> np.ndarray:
        return _stationary(self.vocab_size, self.branching, self.seed, self.order)

    def unigram_entropy(self) -> float:
        succ, probs = self.transitions()
        token = np.zeros(self.vocab_size)
        np.add.at(token, succ.ravel(), (self.stationary()[:, None] * probs).ravel())
        token = token[token > 0]
        return float(-(token * np.log(token)).sum())

    def conditional_entropy(self) -> float:
        """The best achievable loss (nats/token) for a model that knows the chain."""
        _, probs = self.transitions()
        per_context = -(probs * np.log(probs)).sum(axis=1)
        return float((self.stationary() * per_context).sum())

    def batch(self, batch_size: int, seq_len: int, stream: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, labels) of shape [batch, seq]; deterministic in (seed, stream, step) so runs
        resume exactly and each data-parallel stream sees different text."""
        rng = np.random.default_rng([self.seed, stream, step])
        first = rng.integers(0, self.vocab_size, (batch_size, self.order))
        return self._walk(first, rng.random((batch_size, seq_len)))

    def rows(self, seq_len: int, stream: int, steps: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence per step, each ``batch(1, seq_len, stream, step)``, walked together."""
        draws = [np.random.default_rng([self.seed, stream, step]) for step in steps]
        first = np.concatenate([rng.integers(0, self.vocab_size, (1, self.order)) for rng in draws])
        return self._walk(first, np.concatenate([rng.random((1, seq_len)) for rng in draws]))

    def _walk(self, first: np.ndarray, u: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The chain from each row's first ``order`` tokens, one uniform draw per step."""
        succ, _ = self.transitions()
        cum = _cumulative(self.vocab_size, self.branching, self.seed, self.order)
        v, k = self.vocab_size, self.order
        rows, seq_len = u.shape
        seq = np.empty((rows, seq_len + k), dtype=np.int64)
        seq[:, :k] = first
        ctx = np.zeros(rows, dtype=np.int64)
        for j in range(k):
            ctx = ctx * v + seq[:, j]
        for t in range(seq_len):
            choice = (u[:, t, None] > cum[ctx]).sum(axis=1).clip(max=self.branching - 1)
            nxt = succ[ctx, choice]
            seq[:, t + k] = nxt
            ctx = (ctx * v + nxt) % (v**k)
        data = torch.from_numpy(seq[:, k - 1:])
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()


@functools.cache
def _cumulative(vocab_size: int, branching: int, seed: int, order: int) -> np.ndarray:
    return _transitions(vocab_size, branching, seed, order)[1].cumsum(axis=1)
