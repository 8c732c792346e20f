"""FSDP2 gathers each unit only where a step needs it: blocks twice under resharding (forward
and backward), the embedding once (its backward needs no weight), the last unit once (its
backward starts right after its forward). Counted in the profiler over a fake 2-rank group."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.profiler import profile

import loom.parallel.parallelize as recipe
from loom.config import ParallelConfig
from loom.models.llama.model import ModelArgs, Transformer
from loom.parallel.mesh import ParallelDims
from loom.plan.trace import fake_world

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32,
                 max_seq_len=16)


def gathers_per_unit(reshard: str) -> Counter:
    with fake_world(2):
        torch.manual_seed(0)
        model = Transformer(ARGS)
        dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=1, world_size=2)
        dims.build_mesh("cpu")
        recipe.parallelize(model, dims, ParallelConfig(reshard_after_forward=reshard, dtype="fp32"),
                           loss_parallel=False, backend="gloo")
        tokens = torch.randint(ARGS.vocab_size, (2, 8))
        with profile() as prof:
            model(tokens).float().sum().backward()
    names = (e.name for e in prof.events() if e.name.startswith("FSDP::all_gather ("))
    return Counter(name.removeprefix("FSDP::all_gather (").removesuffix(")") for name in names)


@pytest.mark.parametrize("reshard, blocks", [("always", 2), ("never", 1)])
def test_each_unit_is_gathered_only_when_needed(reshard: str, blocks: int) -> None:
    counts = gathers_per_unit(reshard)
    expected = {"tok_embeddings": 1, "layers.0": blocks, "layers.1": blocks,
                "norm, output": 1}
    assert counts == expected, f"all-gathers per unit {dict(counts)}, expected {expected}"
