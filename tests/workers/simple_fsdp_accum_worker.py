"""One rank of the SimpleFSDP gradient-accumulation check (2 ranks, dp_shard 2): three
micro-batches with the sync off until the last against the same three each reduced, in fp32
and bf16, for two steps in a row; prints rank 0's figures as one JSON line."""

from __future__ import annotations

import json
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from loom.config import ParallelConfig
from loom.models.llama.model import ModelArgs, Transformer
from loom.parallel.grad_sync import set_gradient_sync
from loom.parallel.init import clean_name, init_weights
from loom.parallel.mesh import ParallelDims
from loom.parallel.parallelize import parallelize
from loom.runtime.distributed import init_distributed, rank_info, teardown
from tests.workers.parity_worker import full

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32,
                 max_seq_len=16)
MICRO_BATCHES = 3


class Collectives(TorchDispatchMode):
    """Counts the functional collectives (DTensor's) that run, backward included."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, name = func._schema.name.split("::")
        if namespace == "_c10d_functional":
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def build(dims: ParallelDims, dtype: str) -> Transformer:
    with torch.device("meta"):
        model = Transformer(ARGS)
    parallelize(model, dims, ParallelConfig(data_parallel="simple-fsdp", dtype=dtype),
                loss_parallel=False, backend="gloo")
    init_weights(model, seed=3, device=torch.device("cpu"))
    return model


def step(model: Transformer, syncs: list[bool]) -> tuple[dict[str, torch.Tensor], dict]:
    """Full gradients of this rank's micro-batches and the collectives that ran."""
    gen = torch.Generator().manual_seed(11 + dist.get_rank())
    with Collectives() as comm:
        for sync in syncs:
            tokens = torch.randint(ARGS.vocab_size, (1, 17), generator=gen)
            set_gradient_sync(model, sync)
            logits = model(tokens[:, :-1]).float()
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    counts = dict(comm.counts)
    grads = {clean_name(n): full(p.grad) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads, counts


def worst(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> list:
    """Largest |difference| relative to the reference's largest |value|, and where."""
    errors = {n: ((g - reference[n]).abs().max() / reference[n].abs().max()).item()
              for n, g in grads.items()}
    name = max(errors, key=errors.get)
    return [errors[name], name]


def main() -> None:
    info = rank_info()
    init_distributed(info)
    out: dict = {}
    try:
        dims = ParallelDims(1, info.world_size, 1, info.world_size)
        dims.build_mesh("cpu")
        for dtype in ("fp32", "bf16"):
            model = build(dims, dtype)
            out[f"{dtype}/tensors"] = len(list(model.parameters()))
            every, out[f"{dtype}/every"] = step(model, [True] * MICRO_BATCHES)
            for n in (1, 2):  # twice: the deferred gradients must not leak into the next step
                deferred, out[f"{dtype}/deferred{n}"] = step(
                    model, [False] * (MICRO_BATCHES - 1) + [True])
                out[f"{dtype}/error{n}"] = worst(deferred, every)
    finally:
        teardown()
    if info.rank == 0:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
