"""Validation loss: training's step executor (model parts and criterion) under the same
mesh, without gradients (`loom eval` for a saved model is `loom.eval_command`).

The loss is summed over valid tokens and divided once by the global count, exactly as
training reduces it, so a 2-rank dp run and a 1-rank run report the same value.
"""

from __future__ import annotations

import itertools
import logging
import math

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from loom.config import ConfigError, JobConfig
from loom.data.loaders import build_dataloader
from loom.losses import IGNORE_INDEX
from loom.mesh import ParallelDims
from loom.parallel.context import shard_batch
from loom.step import StepExecutor

logger = logging.getLogger("loom")


class Evaluator:
    """The first `steps` global batches of a dataset in a fixed order (the same tokens at
    every evaluation, so the curve compares like with like)."""

    def __init__(self, dataset: Dataset, executor: StepExecutor, dims: ParallelDims,
                 device: torch.device, batch_size: int, steps: int, every: int):
        try:
            self.loader = build_dataloader(dataset, batch_size=batch_size, dp_rank=dims.dp_rank,
                                           dp_size=dims.dp_size, seed=0, num_workers=0,
                                           shuffle=False)
        except ConfigError as e:
            raise ConfigError(f"validation data: {e}") from None
        self.steps = min(steps, self.loader.sampler.steps_per_epoch)
        self.executor, self.dims, self.device, self.every = executor, dims, device, every

    def maybe_evaluate(self, step: int, final: bool) -> dict[str, float]:
        """`val/loss` and `val/ppl` when due (every `every` steps and after the last)."""
        if not (final or (self.every and step % self.every == 0)):
            return {}
        return self.evaluate()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        valid = torch.zeros((), device=self.device, dtype=torch.float64)
        for batch in itertools.islice(self.loader, self.steps):
            batch = shard_batch(batch, self.dims)  # this cp rank's part of the sequences
            loss_sum += self.executor.loss_sum(batch).double()  # this rank's owned share
            valid += (batch["labels"] != IGNORE_INDEX).sum().to(self.device)
        packed = torch.stack([loss_sum, valid * self.executor.owns_loss])
        dist.all_reduce(packed)  # one owner per loss-mesh rank: each token counted once
        loss = float(packed[0] / packed[1])
        return {"val/loss": loss, "val/ppl": math.exp(min(loss, 700.0)),
                "val/tokens": int(packed[1])}


def build_evaluator(dataset: Dataset | None, cfg: JobConfig, dims: ParallelDims,
                    executor: StepExecutor, device: torch.device) -> Evaluator | None:
    if dataset is None:
        return None
    return Evaluator(dataset, executor, dims, device, cfg.train.batch_size,
                     cfg.eval.eval_steps, cfg.eval.eval_every)
