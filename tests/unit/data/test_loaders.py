import pytest
import torch

from loom.config import ConfigError
from loom.data.loaders import GlobalOrderSampler, RandomTokens, build_dataloader


def global_order(dp_size: int, batch: int, steps: int, epoch: int = 0) -> list[list[int]]:
    """Concatenate every dp rank's batch per step, as one step's global batch."""
    per_rank = []
    for r in range(dp_size):
        s = GlobalOrderSampler(64, batch, r, dp_size, seed=3)
        s.set_epoch(epoch)
        per_rank.append(list(s))
    return [sum((ranks[k * batch:(k + 1) * batch] for ranks in per_rank), [])
            for k in range(steps)]


def test_same_global_batches_on_any_dp_degree():
    assert global_order(1, 8, 8) == global_order(2, 4, 8) == global_order(4, 2, 8)


def test_dp_ranks_are_disjoint_and_epochs_reshuffle():
    steps = global_order(4, 2, 8)
    flat = sum(steps, [])
    assert len(flat) == len(set(flat)) == 64
    assert global_order(4, 2, 8, epoch=1) != steps


def test_random_tokens_are_a_function_of_seed_and_index():
    a, b = RandomTokens(100, 16, seed=1), RandomTokens(100, 16, seed=1)
    torch.testing.assert_close(a[5]["input"], b[5]["input"])
    assert not torch.equal(a[5]["input"], a[6]["input"])
    torch.testing.assert_close(a[5]["input"][1:], a[5]["labels"][:-1])


def test_zero_full_batches_is_a_clear_error():
    with pytest.raises(ConfigError, match="zero full batches.*batch size 4 x dp degree 4"):
        build_dataloader(RandomTokens(10, 8, 0, num_samples=10), batch_size=4, dp_rank=0,
                         dp_size=4, seed=0, num_workers=0)
