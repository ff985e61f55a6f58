"""Training batches for the CPU loop: the built-in synthetic corpus, Megatron's mock data
(--mock-data) or Megatron indexed datasets (--data-path), each deterministic in the iteration so a
resumed run sees exactly the batches an uninterrupted one would."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import torch

Batch = tuple[torch.Tensor, torch.Tensor]


def source(args: argparse.Namespace) -> str:
    if args.data_path or args.train_data_path:
        return "indexed"
    return "mock" if args.mock_data else "synthetic"


def corpus(args: argparse.Namespace):  # noqa: ANN201 - MarkovCorpus
    from megatron_hybridep.data.synthetic import MarkovCorpus

    return MarkovCorpus(vocab_size=args.vocab_size or 256, seed=args.seed)


def micro_batches(args: argparse.Namespace, dp_size: int) -> int:
    """Micro-batches per iteration on each data-parallel rank (Megatron's num_microbatches)."""
    return args.global_batch_size // (args.micro_batch_size * dp_size)


def train_batches(args: argparse.Namespace, start_iteration: int = 0) -> Iterator[Batch]:
    from megatron.core import parallel_state as ps

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    micro = micro_batches(args, dp_size)
    kind = source(args)
    sample = start_iteration * args.global_batch_size
    if kind == "synthetic":
        # one sequence per global sample index, in Megatron's order (below): every layout (DP size,
        # micro-batches) trains on the same global batches
        c = corpus(args)
        while True:
            for m in range(micro):
                first = sample + (m * dp_size + dp_rank) * args.micro_batch_size
                yield c.rows(args.seq_length, 0, [first + j for j in range(args.micro_batch_size)])
            sample += args.global_batch_size
    dataset = _megatron_dataset(args, kind)
    while True:
        # Megatron's order: a global batch is dp_size * micro micro-batches; this rank's micro-batch
        # m takes samples [m*dp*mbs + dp_rank*mbs, ... + mbs).
        for m in range(micro):
            first = sample + (m * dp_size + dp_rank) * args.micro_batch_size
            items = [dataset[(first + j) % len(dataset)] for j in range(args.micro_batch_size)]
            tokens = torch.stack([torch.as_tensor(it["tokens"]) for it in items]).long()
            labels = torch.stack([torch.as_tensor(it["labels"]) for it in items]).long()
            yield tokens, labels
        sample += args.global_batch_size


def _megatron_dataset(args: argparse.Namespace, kind: str):  # noqa: ANN202
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_tokenizer

    from megatron_hybridep.megatron.training_hooks import build_tokenizer

    try:
        tokenizer = get_tokenizer()
    except AssertionError:
        tokenizer = build_tokenizer(args)
    blend = None
    if kind == "indexed":
        from megatron.core.datasets.utils import get_blend_from_list

        blend = get_blend_from_list(args.data_path)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
        split=args.split or "100,0,0", tokenizer=tokenizer, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, mmap_bin_files=True,
        path_to_cache=args.data_cache_path, mid_level_dataset_surplus=0.005)
    samples = args.train_iters * args.global_batch_size
    dataset_type = MockGPTDataset if kind == "mock" else GPTDataset
    train, _, _ = BlendedMegatronDatasetBuilder(dataset_type, [samples, 0, 0], lambda: True, config).build()
    return train
