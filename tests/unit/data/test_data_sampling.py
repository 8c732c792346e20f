"""Global-order sampling: starting mid-epoch, and the zero-batches error's content."""

from __future__ import annotations

import pytest

from loom.config import ConfigError
from loom.data.loaders import GlobalOrderSampler, RandomTokens, build_dataloader


def test_start_step_continues_the_same_epoch_order():
    full = GlobalOrderSampler(100, 3, dp_rank=1, dp_size=2, seed=5)
    full.set_epoch(2)
    order = list(full)
    resumed = GlobalOrderSampler(100, 3, dp_rank=1, dp_size=2, seed=5)
    resumed.set_epoch(2, start_step=4)
    assert list(resumed) == order[4 * 3:]
    assert len(resumed) == len(order) - 4 * 3
    resumed.set_epoch(3)
    assert len(list(resumed)) == len(order)


def test_zero_full_batches_names_size_degree_and_flags():
    with pytest.raises(ConfigError) as info:
        build_dataloader(RandomTokens(10, 8, 0, num_samples=6), batch_size=2, dp_rank=0,
                         dp_size=4, seed=0, num_workers=0)
    message = str(info.value)
    for part in ("dataset has 6 samples", "batch size 2 x dp degree 4", "--batch-size",
                 "--dp-shard", "--seq-len"):
        assert part in message
