"""One rank of the whole-matrix orthogonalization check (4 ranks, a 2 x 2 mesh): for each
layout, matrices sharded as FSDP2, TP, FSDP2 over TP (strided) and EP x FSDP place them,
orthogonalized by `loom.parallel.orthogonalize`, by torch's Newton-Schulz on the whole
matrices, and naively shard by shard; prints rank 0's worst differences and every rank's
count of matrices it orthogonalized, as one JSON line."""

from __future__ import annotations

import json
import sys
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from loom.compat import newton_schulz
from loom.parallel.orthogonalize import orthogonalize
from loom.runtime.distributed import init_distributed, rank_info, teardown

NS = partial(newton_schulz, ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, eps=1e-7)
LAYOUTS = {  # name: (placements on the (dp, tp) mesh, global shapes)
    "fsdp_dp2": ([Shard(0), Replicate()], [(48, 32)] * 4 + [(32, 48)]),
    "tp2_rowwise": ([Replicate(), Shard(1)], [(32, 48)] * 3),
    "dp2_tp2_colwise": ([_StridedShard(0, split_factor=2), Shard(0)], [(48, 32)] * 4),
    "dp2_tp2_rowwise": ([Shard(0), Shard(1)], [(32, 48)] * 5),
    "ep2_fsdp2_experts": ([Shard(1), Shard(0)], [(4, 24, 16)]),
}


def whole(full: torch.Tensor) -> torch.Tensor:
    return NS(full) if full.ndim == 2 else torch.stack([NS(m) for m in full])


def check(mesh, placements, shapes: list[tuple[int, ...]]) -> dict[str, float]:
    gen = torch.Generator().manual_seed(3)
    fulls = [torch.randn(s, generator=gen) for s in shapes]
    shards = [DTensor.from_local(f, mesh, [Replicate(), Replicate()]).redistribute(
        mesh, placements) for f in fulls]
    calls = []
    counted = (lambda m: calls.append(1) or NS(m))  # noqa: E731
    done = orthogonalize(shards, counted)
    worst_loom = worst_naive = 0.0
    for full, shard, local in zip(fulls, shards, done, strict=True):
        result = DTensor.from_local(local, mesh, placements, shape=shard.shape,
                                    stride=shard.stride()).full_tensor()
        naive = DTensor.from_local(whole(shard.to_local()).to(full.dtype), mesh, placements,
                                   shape=shard.shape, stride=shard.stride()).full_tensor()
        expected = whole(full).to(full.dtype)
        worst_loom = max(worst_loom, (result - expected).abs().max().item())
        worst_naive = max(worst_naive, (naive - expected).abs().max().item())
    counts = [0] * dist.get_world_size()
    dist.all_gather_object(counts, len(calls))
    return {"loom": worst_loom, "naive": worst_naive, "calls": counts}


def main() -> None:
    init_distributed(rank_info())
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    results = {}
    for name, (placements, shapes) in LAYOUTS.items():
        results[name] = check(mesh, placements, shapes)
        print(f"rank {dist.get_rank()}: {name} done", file=sys.stderr, flush=True)
    if dist.get_rank() == 0:
        print(json.dumps(results), flush=True)
    teardown()


if __name__ == "__main__":
    main()
