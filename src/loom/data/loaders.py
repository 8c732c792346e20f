"""Distributed sampling in one global order, and the synthetic random-token dataset.

Step k of an epoch consumes global samples k*G ... k*G+G-1 (G = global batch) of one seeded
permutation; dp rank r takes its contiguous slice of B = G / dp. Ranks that differ only in
tp get the same slice, and a run on another dp degree with the same G sees the same data.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from loom.config import ConfigError

RANDOM_DATASET_SAMPLES = 8192
"""Length of the synthetic dataset: an epoch of `random` is this many samples."""


class RandomTokens(Dataset):
    """Synthetic tokens with Zipf-like frequencies, as in natural text, so the loss has
    somewhere to fall. Sample i is a pure function of (seed, i): every mesh sees identical
    data without any I/O."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int,
                 num_samples: int = RANDOM_DATASET_SAMPLES):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.num_samples = num_samples
        self.probs = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 7_919 + index)
        window = torch.multinomial(self.probs, self.seq_len + 1, replacement=True,
                                   generator=gen)
        return {"input": window[:-1], "labels": window[1:]}


class GlobalOrderSampler(Sampler[int]):
    """Yields this dp rank's indices, batch after batch, from one seeded global permutation."""

    def __init__(self, dataset_size: int, batch_size: int, dp_rank: int, dp_size: int,
                 seed: int, shuffle: bool = True):
        self.dataset_size, self.batch_size = dataset_size, batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle, self.epoch = seed, shuffle, 0

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.dp_size

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset_size // self.global_batch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps_per_epoch * self.batch_size

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + 1_000_003 * self.epoch)
            order = torch.randperm(self.dataset_size, generator=gen)
        else:
            order = torch.arange(self.dataset_size)
        start = self.dp_rank * self.batch_size
        for step in range(self.steps_per_epoch):
            base = step * self.global_batch + start
            yield from order[base:base + self.batch_size].tolist()


def build_dataloader(dataset: Dataset, *, batch_size: int, dp_rank: int, dp_size: int,
                     seed: int, num_workers: int) -> DataLoader:
    """A loader that drops the ragged tail in sampler and loader alike (ragged shapes force
    recompiles); fails when that leaves no full batch for this rank."""
    sampler = GlobalOrderSampler(len(dataset), batch_size, dp_rank, dp_size, seed)
    if sampler.steps_per_epoch == 0:
        raise ConfigError(
            f"zero full batches on this rank: dataset has {len(dataset)} samples but one "
            f"step needs batch size {batch_size} x dp degree {dp_size} = "
            f"{sampler.global_batch}; lower --batch-size, use fewer data-parallel ranks "
            "(--dp-shard/--dp-replicate or more --tp), shorten --seq-len or add data")
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True,
                      num_workers=num_workers, persistent_workers=num_workers > 0)
