"""One rank of the split-backward reproduction (tests/parity/test_upstream_zbv.py), torch
only: 4 tiny stages in torch's V shape over 2 pp ranks (rank r holds stages r and 3 - r),
one ScheduleZBVZeroBubble step over 2 micro-batches per wrapping named on the command line:
`plain`, `fsdp2` (each stage one fully_shard unit) or `nested` (fully_shard on each of the
stage's two blocks, then on the stage, as loom wraps a stage). The dp mesh has one rank, so
no reduction can differ. Prints one JSON line: per wrapping, the largest relative
difference of a weight gradient from the same model's one-process backward over the whole
batch."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble
from torch.distributed.tensor import DTensor

N_STAGES, WIDTH, BATCH = 4, 8, 4


def layers() -> list[nn.Module]:
    """The same weights on every rank and in the reference."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
                          nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()))
            for _ in range(N_STAGES)]


def squared_error(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).sum()


def full(grad: torch.Tensor | None) -> torch.Tensor:
    if grad is None:
        return torch.zeros(())
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def worst_error(wrap: str, mesh: DeviceMesh, x: torch.Tensor, y: torch.Tensor,
                reference: list[nn.Module]) -> float:
    """One schedule step under `wrap`; the largest relative weight-gradient error."""
    rank = dist.get_rank()
    ids = [rank, N_STAGES - 1 - rank]
    every = layers()
    parts = [every[i] for i in ids]
    if wrap != "plain":
        for part in parts:
            if wrap == "nested":  # as loom wraps: each block, then the stage
                for block in part:
                    fully_shard(block, mesh=mesh["dp"])
            fully_shard(part, mesh=mesh["dp"])
    group = mesh["pp"].get_group()
    stages = [PipelineStage(part, i, N_STAGES, torch.device("cpu"), group=group)
              for part, i in zip(parts, ids, strict=True)]
    schedule = ScheduleZBVZeroBubble(stages, 2, loss_fn=squared_error, scale_grads=False)
    if rank == 0:  # holds stage 0 (input) and stage 3 (loss)
        schedule.step(x, target=y)
    else:
        schedule.step()
    worst = 0.0
    for i, part in zip(ids, parts, strict=True):
        for param, want in zip(part.parameters(), reference[i].parameters(),
                               strict=True):
            worst = max(worst, float((full(param.grad) - want.grad).norm()
                                     / want.grad.norm()))
    return worst


def main(wraps: list[str]) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    data = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=data)
    y = torch.randn(BATCH, WIDTH, generator=data)
    reference = layers()
    squared_error(nn.Sequential(*reference)(x), y).backward()
    errors = {wrap: worst_error(wrap, mesh, x, y, reference) for wrap in wraps}
    print(json.dumps({"rank": dist.get_rank(), "worst_relative": errors}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
