"""SimpleFSDP pieces: flag, mode choice, stored placements, gradient scaling, the gather
parametrization; and (one in-process rank) names, init and state-dict keys equal FSDP2's."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from loom.checkpoint.checkpointer import plain_state_dict
from loom.compat import checkpoint_inside_compile_saves_mesh
from loom.config import ConfigError, ParallelConfig, config_from_flags
from loom.models.moe.model import MoEArgs, MoETransformer
from loom.parallel import simple_fsdp as sf
from loom.parallel.init import clean_name, init_weights
from loom.parallel.mesh import ParallelDims
from loom.parallel.parallelize import parallelize
from tests.one_rank import one_rank_group


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
        config_from_flags({"model": "org/tiny-llama", "model_impl": "transformers",
                           "data_parallel": "simple-fsdp"}, environ={})


def test_compile_with_ac_is_accepted_under_simple_fsdp_and_selective_where_it_runs() -> None:
    """Block AC compiles on every torch (`loom.parallel.parallelize.checkpoint_outside_
    compile`); selective only where the torch runs a checkpoint inside the graph."""
    flags = {"data_parallel": "simple-fsdp", "compile": True}
    cfg = config_from_flags({**flags, "activation_checkpoint": "block"}, environ={})
    assert cfg.parallel.activation_checkpoint == "block"
    if checkpoint_inside_compile_saves_mesh():
        with pytest.raises(ConfigError, match="selective .* fails in torch"):
            config_from_flags({**flags, "activation_checkpoint": "selective"}, environ={})
    else:
        config_from_flags({**flags, "activation_checkpoint": "selective"}, environ={})


@pytest.mark.parametrize(("replicate", "shard", "cp", "dims", "mode"), [
    (1, 4, 1, ("dp_shard",), "fully_shard"),
    (4, 1, 1, ("dp_replicate",), "replicate"),
    (2, 2, 1, ("dp_replicate", "dp_shard"), "hybrid_shard"),
    (1, 1, 1, ("dp_shard",), "fully_shard"),
    (1, 1, 2, ("dp_shard_cp",), "fully_shard"),  # cp ranks hold different tokens: they shard
    (2, 1, 2, ("dp_replicate", "dp_shard_cp"), "hybrid_shard"),
])
def test_mode_follows_the_mesh_degrees(replicate: int, shard: int, cp: int, dims: tuple,
                                       mode: str) -> None:
    parallel = ParallelDims(replicate, shard, 1, replicate * shard * cp, cp=cp)
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
    sf.gather_on_read(layer, "weight", recording)
    assert isinstance(layer, nn.Linear)
    torch.testing.assert_close(layer.weight, stored * 2)
    assert recording.seen == [stored]
    (key,) = layer.state_dict()
    assert clean_name(key) == "weight"
    assert torch.equal(layer.state_dict()[key], stored)  # not the gathered (x2) value
    assert list(layer.parameters()) == [stored]


def test_clean_name_drops_wrappers_and_parametrizations() -> None:
    assert clean_name("layers.0._checkpoint_wrapped_module.attention.wq.parametrizations."
                      "weight.original") == "layers.0.attention.wq.weight"
    assert clean_name("parametrizations.w1.original") == "w1"
    assert clean_name("layers.1.moe.experts.w1") == "layers.1.moe.experts.w1"


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


MOE = MoEArgs(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=32, multiple_of=16,
              max_seq_len=8, n_experts=4, top_k=2, n_dense_layers=1)


def wrapped(data_parallel: str) -> tuple[MoETransformer, torch.optim.Optimizer]:
    """The tiny MoE model (routed experts, a dense block, AC wrappers) on a 1-rank mesh
    (FSDP2 there too, not the single-device path's plain module)."""
    dims = ParallelDims(1, 1, 1, 1)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = MoETransformer(MOE)
    parallelize(model, dims, ParallelConfig(data_parallel=data_parallel, dtype="fp32",
                                            activation_checkpoint="block",
                                            single_device="fsdp2"),
                loss_parallel=False, backend="gloo")
    init_weights(model, seed=5, device=torch.device("cpu"))
    return model, torch.optim.AdamW(model.parameters())


def test_names_init_and_state_dict_keys_match_fsdp2() -> None:
    """Under plain names, SimpleFSDP's parameters, their seeded values and the model and
    optimizer state-dict keys are FSDP2's; the way back gives the model's own names."""
    with one_rank_group():
        states = {}
        for data_parallel in ("fsdp2", "simple-fsdp"):
            model, optimizer = wrapped(data_parallel)
            values = {clean_name(n): p.full_tensor() for n, p in model.named_parameters()}
            states[data_parallel] = (values, *plain_state_dict(model, optimizer))
    (fsdp2, f_model, f_optim, _), (simple, s_model, s_optim, own_name) = states.values()
    assert "layers.1.moe.experts.w1" in simple and len(simple) == len(fsdp2)
    for name, value in fsdp2.items():
        assert torch.equal(simple[name], value), f"{name} initialised differently"
    assert list(s_model) == list(f_model)
    assert list(s_optim["state"]) == list(f_optim["state"])
    assert [g["params"] for g in s_optim["param_groups"]] == [
        g["params"] for g in f_optim["param_groups"]]
    assert own_name("layers.0.attention.wq.weight") == (
        "layers.0.attention.wq.parametrizations.weight.original")
