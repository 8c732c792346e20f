"""One rank of a parity job: train several configurations in one process group, saving
rank 0's losses (in the run folder) and the final full parameters (params.pt) of each.
With `--grads`, also the full gradients of one more batch at the final weights (grads.pt);
with `--first-grads`, the full gradients of the first step's batch at the initial weights
(first-grads.pt; dense models only: an MoE forward would move its routing counts)."""

from __future__ import annotations

import json
import sys

import torch
from torch.distributed.tensor import DTensor

from loom.cli import setup_logging
from loom.config import parse_args
from loom.mesh import ParallelDims
from loom.parallel.context import shard_batch
from loom.parallel.init import clean_name
from loom.runtime import init_distributed, rank_info, teardown
from loom.train import Trainer


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {clean_name(n): full(p) for n, p in model.named_parameters()}


def batch_gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Gradients of the loader's first batch under the run's loss, dp-averaged by FSDP like a
    training step; the model's gradients are cleared again."""
    batch = shard_batch(next(iter(trainer.loader)), trainer.dims)
    inputs, labels = batch["input"].to(trainer.device), batch["labels"].to(trainer.device)
    trainer.loss_fn(trainer.model, inputs, labels).backward()
    grads = {clean_name(n): full(p.grad) for n, p in trainer.model.named_parameters()}
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads


def main(runs: list[list[str]], options: list[str]) -> None:
    info = rank_info()
    setup_logging(info.rank)
    device = init_distributed(info)
    try:
        for argv in runs:
            torch._dynamo.reset()  # compiled blocks of an earlier run would be reused as-is
            cfg = parse_args(argv)
            trainer = Trainer(cfg, info, ParallelDims.from_config(cfg.parallel, info.world_size),
                              device)
            saved = {}
            if "--first-grads" in options:
                saved["first-grads.pt"] = batch_gradients(trainer)
            try:
                trainer.fit()
            finally:
                trainer.close()
            saved["params.pt"] = full_parameters(trainer.model)
            if "--grads" in options:
                saved["grads.pt"] = batch_gradients(trainer)
            if info.rank == 0:
                for name, tensors in saved.items():
                    torch.save(tensors, trainer.metrics.outdir / name)
    finally:
        teardown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2:])
