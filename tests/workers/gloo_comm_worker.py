"""One rank of the pairwise-collectives check (4 ranks): all-gather and reduce-scatter (sum,
average, async) against gloo's own on the world group, on two interleaved pairs (global
ranks 0,2 and 1,3) and on a 3-rank group; prints the worst differences as one JSON line."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from loom.parallel.gloo_comm import PairwiseAllGather, PairwiseReduceScatter
from loom.runtime.distributed import init_distributed, rank_info, teardown


def worst_differences(group: dist.ProcessGroup) -> dict[str, float]:
    rank, size = group.rank(), group.size()
    gen = torch.Generator().manual_seed(7 + dist.get_rank())
    shard = torch.randn(1001, generator=gen)
    full = torch.randn(1001 * size, generator=gen)
    out: dict[str, float] = {}
    expected = torch.empty(1001 * size)
    dist.all_gather_into_tensor(expected, shard, group=group)
    for async_op in (False, True):
        gathered = torch.full((1001 * size,), float("nan"))
        gathered.view(size, -1)[rank].copy_(shard)  # FSDP's copy-in puts the shard in place
        work = PairwiseAllGather()(gathered, shard, group, async_op=async_op)
        assert (work is not None) == async_op
        if work is not None:
            work.wait()
        out[f"all_gather{'_async' if async_op else ''}"] = (gathered - expected).abs().max().item()
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        summed = full.clone()
        dist.all_reduce(summed, group=group)
        expected_shard = summed.view(size, -1)[rank] / (size if op == dist.ReduceOp.AVG else 1)
        reduced = torch.empty(1001)
        PairwiseReduceScatter()(reduced, full.clone(), group, op=op)  # it reuses its input
        out[f"reduce_scatter_{op}"] = (reduced - expected_shard).abs().max().item()
    return out


def main() -> None:
    init_distributed(rank_info())
    groups = {"world": dist.group.WORLD,
              "pairs": dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])[0],
              "three": dist.new_group([1, 2, 3])}
    results = {name: worst_differences(group) for name, group in groups.items()
               if name != "three" or dist.get_rank() != 0}
    print(json.dumps(results), flush=True)
    teardown()


if __name__ == "__main__":
    main()
