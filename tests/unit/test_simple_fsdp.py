"""SimpleFSDP pieces that need no process group: flag, mode choice, stored placements,
gradient scaling, the attribute swap."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from loom.config import ConfigError, config_from_flags
from loom.mesh import ParallelDims
from loom.parallel import simple_fsdp as sf


class FakeMesh:
    def __init__(self, *sizes: int):
        self.sizes = sizes

    def size(self, dim: int = 0) -> int:
        return self.sizes[dim]


def test_flag_defaults_to_fsdp2_and_accepts_simple_fsdp() -> None:
    assert config_from_flags({}, environ={}).parallel.data_parallel == "fsdp2"
    cfg = config_from_flags({"data_parallel": "simple-fsdp"}, environ={})
    assert cfg.parallel.data_parallel == "simple-fsdp"


def test_hugging_face_models_are_refused_with_one_line() -> None:
    with pytest.raises(ConfigError, match="--data-parallel simple-fsdp needs loom's own model"):
        config_from_flags({"model": "org/tiny-llama", "data_parallel": "simple-fsdp"},
                          environ={})


def test_compile_with_ac_warns_under_simple_fsdp() -> None:
    cfg = config_from_flags({"data_parallel": "simple-fsdp", "compile": True,
                             "activation_checkpoint": "block"}, environ={})
    assert any("known to fail upstream" in w for w in cfg.warnings)


@pytest.mark.parametrize(("replicate", "shard", "dims", "mode"), [
    (1, 4, ("dp_shard",), "fully_shard"),
    (4, 1, ("dp_replicate",), "replicate"),
    (2, 2, ("dp_replicate", "dp_shard"), "hybrid_shard"),
    (1, 1, ("dp_shard",), "fully_shard"),
])
def test_mode_follows_the_mesh_degrees(replicate: int, shard: int, dims: tuple, mode: str) -> None:
    parallel = ParallelDims(replicate, shard, 1, replicate * shard)
    assert sf.dense_dp_dims(parallel) == dims
    assert sf.mode_name(dims) == mode
    assert sf.dp_placements(dims) == tuple(
        Replicate() if d == "dp_replicate" else Shard(0) for d in dims)


def test_dp_shard_is_strided_where_tp_shards_the_same_dim() -> None:
    dp = (Replicate(), Shard(0))
    assert sf._stored_placements(dp, None, ()) == dp
    assert sf._stored_placements(dp, FakeMesh(2), (Shard(1),)) == (Replicate(), Shard(0),
                                                                   Shard(1))
    assert sf._stored_placements(dp, FakeMesh(2), (Replicate(),)) == (*dp, Replicate())
    assert sf._stored_placements(dp, FakeMesh(3, 2), (Shard(0), Shard(1))) == (
        Replicate(), _StridedShard(0, split_factor=3), Shard(0), Shard(1))


def test_scale_grad_is_identity_forward_and_scales_backward() -> None:
    x = torch.randn(3, requires_grad=True)
    y = sf._ScaleGrad.apply(x, 0.25)
    torch.testing.assert_close(y, x)
    (y * 2).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 0.5))


class Recording:
    """A gather stand-in that records the parameters it was asked for."""

    def __init__(self):
        self.seen: list[torch.Tensor] = []

    def __call__(self, param: torch.Tensor) -> torch.Tensor:
        self.seen.append(param)
        return param * 2


def test_attribute_reads_gather_and_state_dict_sees_storage() -> None:
    layer = nn.Linear(2, 2, bias=False)
    stored = layer.weight
    recording = Recording()
    layer._simple_fsdp_gathers = {"weight": recording}
    sf._swap_class(layer, ("weight",), root=True)
    assert isinstance(layer, nn.Linear) and type(layer).__name__ == "SimpleFSDPLinear"
    torch.testing.assert_close(layer.weight, stored * 2)
    assert recording.seen == [stored]
    assert torch.equal(layer.state_dict()["weight"], stored)  # not the gathered (x2) value
    assert list(layer.parameters()) == [stored]


def test_deferred_gradients_are_handed_to_the_synced_backward_once() -> None:
    sync = sf.GradSync(torch.float32)
    sync.set(False, torch.Size([3]), torch.device("cpu"))
    assert sync.deferring()
    for scale in (1.0, 2.0):
        x = torch.ones(3, requires_grad=True)
        (sync.defer(x * 1) * scale).sum().backward()
        assert x.grad is None, "a deferred gradient must not reach the reduction"
    sync.set(True, torch.Size([3]), torch.device("cpu"))
    torch.testing.assert_close(sync.pending, torch.full((3,), 3.0))
    assert not sync.deferring() and sync.buffer is None
    sync.set(False, torch.Size([3]), torch.device("cpu"))
    assert sync.pending is None and sync.buffer.grad is None


def test_add_grad_is_identity_forward_and_adds_backward() -> None:
    x = torch.randn(3, requires_grad=True)
    y = sf._AddGrad.apply(x, torch.full((3,), 0.5))
    torch.testing.assert_close(y, x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 1.5))
