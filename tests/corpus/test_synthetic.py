"""The built-in synthetic corpus: a micro-batch walked row by row together (MarkovCorpus.rows) is the
sequences batch(1, ...) gives one at a time, so every layout and a resumed run see the same text."""

import numpy as np
import pytest
import torch

from megatron_hybridep.data.synthetic import MarkovCorpus


@pytest.mark.parametrize("order", [1, 2])
def test_rows_walked_together_equal_one_sequence_at_a_time(order):
    c = MarkovCorpus(vocab_size=64, seed=7, order=order)
    steps = [3, 11, 12, 40]
    tokens, labels = c.rows(33, 2, steps)
    one = [c.batch(1, 33, 2, s) for s in steps]
    assert torch.equal(tokens, torch.cat([t for t, _ in one])) and torch.equal(labels, torch.cat([y for _, y in one]))
    assert torch.equal(tokens[:, 1:], labels[:, :-1])
    assert not torch.equal(tokens[0], tokens[1])  # each step its own text


def test_every_token_follows_a_successor_of_its_context():
    c = MarkovCorpus(vocab_size=32, seed=1)
    succ, _ = c.transitions()
    tokens, labels = c.rows(50, 0, list(range(6)))
    allowed = succ[tokens.numpy()]  # order 1: the context is the previous token
    assert np.all((allowed == labels.numpy()[..., None]).any(axis=-1))
