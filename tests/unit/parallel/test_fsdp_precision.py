"""FSDP2's mixed precision as torchtitan sets it: forward inputs are not cast, so the RoPE
table reaches every block in fp32 (no bf16 copy per block per step) while the activations
are bf16 from the bf16 weights; gradients come back in the reduce dtype asked for."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import profile

import loom.parallel.parallelize as recipe
from loom.config import ParallelConfig
from loom.models.llama.model import ModelArgs, Transformer
from loom.parallel.fsdp import mixed_precision
from loom.parallel.mesh import ParallelDims
from loom.plan.trace import fake_world

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32,
                 max_seq_len=16)


@pytest.mark.parametrize("dtype, reduce", [("bf16", "fp32"), ("bf16", "bf16"),
                                           ("fp32", "fp32")])
def test_the_policy_casts_no_forward_input(dtype: str, reduce: str) -> None:
    policy = mixed_precision(dtype, reduce)
    assert policy.cast_forward_inputs is False
    assert policy.reduce_dtype == (torch.float32 if (dtype, reduce) == ("bf16", "fp32")
                                   else None)


def test_blocks_get_the_rope_table_in_fp32_and_bf16_activations() -> None:
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    with fake_world(2):
        torch.manual_seed(0)
        model = Transformer(ARGS)
        dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=1, world_size=2)
        dims.build_mesh("cpu")
        recipe.parallelize(model, dims, ParallelConfig(dtype="bf16", reduce_dtype="fp32"),
                           loss_parallel=False, backend="gloo")
        for block in model.layers.values():
            block.register_forward_pre_hook(lambda m, args: seen.append(
                (args[0].dtype, args[1].dtype)))
        tokens = torch.randint(ARGS.vocab_size, (2, 8))
        with profile(record_shapes=True) as prof:
            model(tokens).float().sum().backward()
    assert seen == [(torch.bfloat16, torch.float32)] * ARGS.n_layers
    table = [ARGS.max_seq_len, ARGS.head_dim // 2, 2]
    casts = [e for e in prof.events() if e.name == "aten::_to_copy"
             and e.input_shapes and e.input_shapes[0] == table]
    assert not casts, "the RoPE table was cast"
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
