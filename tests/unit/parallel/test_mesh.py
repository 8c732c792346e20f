from unittest import mock

import pytest

from loom.config import ConfigError
from loom.parallel.mesh import ParallelDims


def test_auto_dp_shard_takes_remaining_ranks():
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=8)
    assert dims.dp_shard == 2 and dims.dp_size == 4
    assert dims.global_batch_size(3) == 12


def test_replica_groups_read_the_data_as_one_more_dp_dimension():
    """--ft-replica-groups 3: each group's mesh is the world it runs in; its samples are a
    third of the global batch, and group 2's dp ranks read after groups 0 and 1's."""
    dims = ParallelDims(1, -1, 1, world_size=2, replica_groups=3, replica_group=2)
    assert dims.dp_size == 2 and dims.data_size == 6
    assert dims.global_batch_size(3) == 18
    with mock.patch.object(ParallelDims, "dp_rank", property(lambda _: 1)):  # no mesh here
        assert dims.data_rank == 5


def test_auto_dp_shard_must_divide():
    with pytest.raises(ConfigError, match="world size 4 divisible by dp_replicate 1 x tp 3"):
        ParallelDims(1, -1, 3, world_size=4)


def test_product_must_equal_world_size():
    with pytest.raises(ConfigError, match="= 4 does not equal world size 8"):
        ParallelDims(2, 2, 1, world_size=8)


def test_enabled_flags():
    dims = ParallelDims(1, -1, 2, world_size=2)
    assert dims.tp_enabled and dims.dp_size == 1 and not dims.dp_replicate_enabled
