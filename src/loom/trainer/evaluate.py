"""Validation loss: training's step executor (model parts and criterion) under the same
mesh, without gradients (`loom eval` for a saved model is `loom.commands.eval`).

The loss is summed over valid tokens and divided once by the global count, exactly as
training reduces it, so a 2-rank dp run and a 1-rank run report the same value. Each set is
read in windows overlapping by one token (`for_evaluation`) and padded to whole global
batches with windows whose labels are all ignored, so the whole set scores every token
after its first, at any dp degree and batch size.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from loom.config import ConfigError, JobConfig
from loom.config.valsets import val_prefix
from loom.data.loaders import build_dataloader
from loom.losses import IGNORE_INDEX
from loom.parallel.context import shard_batch
from loom.parallel.mesh import ParallelDims
from loom.trainer.step import StepExecutor

logger = logging.getLogger("loom")


class WholeBatches(Dataset):
    """`dataset` followed by as many label-free windows (a copy of its first, every label
    ignored) as fill the last global batch: the sampler drops no real window."""

    def __init__(self, dataset: Dataset, global_batch: int):
        self.dataset, self.n = dataset, len(dataset)
        self.padded = -(-self.n // global_batch) * global_batch

    def __len__(self) -> int:
        return self.padded

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index < self.n:
            return self.dataset[index]
        item = dict(self.dataset[0])
        item["labels"] = torch.full_like(item["labels"], IGNORE_INDEX)
        return item


def scoring_view(dataset: Dataset) -> Dataset:
    """The windows evaluation reads: overlapping by one where the dataset offers them
    (packed text and chat), else the dataset itself (random tokens)."""
    view = getattr(dataset, "for_evaluation", None)
    return view() if callable(view) else dataset


class Evaluator:
    """One set's first `steps` global batches (0: all of them) in a fixed order: the same
    tokens at every evaluation, so the curve compares like with like. Its keys are
    `<prefix>loss`, `<prefix>ppl` and `<prefix>tokens` (the label tokens scored)."""

    def __init__(self, dataset: Dataset, executor: StepExecutor, dims: ParallelDims,
                 device: torch.device, batch_size: int, steps: int, every: int,
                 prefix: str = "val/"):
        whole = WholeBatches(scoring_view(dataset), dims.global_batch_size(batch_size))
        try:
            self.loader = build_dataloader(whole, batch_size=batch_size, dp_rank=dims.dp_rank,
                                           dp_size=dims.dp_size, seed=0, num_workers=0,
                                           shuffle=False)
        except ConfigError as e:
            raise ConfigError(f"validation data: {e}") from None
        self.batches = self.loader.sampler.steps_per_epoch
        self.steps = self.batches if steps == 0 else min(steps, self.batches)
        self.executor, self.dims, self.device, self.every = executor, dims, device, every
        self.prefix = prefix

    @property
    def whole(self) -> bool:
        """Whether an evaluation reads every window of the set."""
        return self.steps == self.batches

    def maybe_evaluate(self, step: int, final: bool) -> dict[str, float]:
        """The set's keys when due (every `every` steps and after the last)."""
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
        return {f"{self.prefix}loss": loss, f"{self.prefix}ppl": math.exp(min(loss, 700.0)),
                f"{self.prefix}tokens": int(packed[1])}


class Periodic(Protocol):
    """An evaluation of its own cadence (benchmark tasks: `loom.lmeval.periodic`)."""

    def maybe_evaluate(self, step: int, final: bool) -> dict[str, float]: ...


class Validation:
    """Every validation set of a run, evaluated at the same steps, in the order given; the
    keys of all of them in one dict (each set's under its own prefix), with those of the
    run's other evaluations (`others`, each when it is due)."""

    def __init__(self, evaluators: dict[str, Evaluator], others: Sequence[Periodic] = ()):
        self.evaluators, self.others = evaluators, list(others)

    def maybe_evaluate(self, step: int, final: bool) -> dict[str, float]:
        return {k: v for e in [*self.evaluators.values(), *self.others]
                for k, v in e.maybe_evaluate(step, final).items()}

    def evaluate(self) -> dict[str, float]:
        return {k: v for e in self.evaluators.values() for k, v in e.evaluate().items()}


def build_validation(datasets: dict[str, Dataset], executor: StepExecutor, dims: ParallelDims,
                     device: torch.device, batch_size: int, steps: int,
                     every: int) -> Validation:
    """One evaluator per set, its keys under `val/` (the default set) or `val/NAME/`."""
    return Validation({name: Evaluator(ds, executor, dims, device, batch_size, steps, every,
                                       prefix=val_prefix(name))
                       for name, ds in datasets.items()})


def build_evaluator(datasets: dict[str, Dataset], cfg: JobConfig, dims: ParallelDims,
                    executor: StepExecutor, device: torch.device,
                    others: Sequence[Periodic | None] = ()) -> Validation | None:
    """The run's validation and other evaluations (None without any)."""
    others = [o for o in others if o is not None]
    if not datasets and not others:
        return None
    validation = build_validation(datasets, executor, dims, device, cfg.train.batch_size,
                                  cfg.eval.eval_steps, cfg.eval.eval_every)
    validation.others = others
    return validation
