"""Several trainings in one process group, and what they ended with in full: the shared
part of `loom verify` and the parity tests' worker. Every rank trains each configuration in
turn (the same seed and data), then the parameters are gathered whole, by their plain names,
so layouts that shard them differently can be compared element by element."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from loom.config import parse_args
from loom.parallel.context import shard_batch
from loom.parallel.init import clean_name
from loom.runtime.distributed import RankInfo
from loom.trainer.scoped import training
from loom.trainer.trainer import Trainer


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU (a collective for a DTensor: every rank must call it)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {clean_name(n): full(p) for n, p in model.named_parameters()}


def whole_model(trainer: Trainer, value: Callable[[torch.Tensor], torch.Tensor],
                ) -> dict[str, torch.Tensor]:
    """`value(parameter)` in full for every parameter of the model, by its plain name; each
    pipeline stage's from the ranks that hold it."""
    mine = {clean_name(n): full(value(p)) for part in trainer.model_parts
            for n, p in part.named_parameters()}
    if not trainer.dims.pp_enabled:
        return mine
    stages: list[dict | None] = [None] * trainer.dims.pp
    dist.all_gather_object(stages, mine, group=trainer.dims.get_mesh("pp").get_group())
    return {name: t for stage in stages for name, t in stage.items()}


def batch_gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Gradients of the loader's first batch through the run's step executor, weighted and
    dp-averaged like a training step (each cp rank takes its shard of it); the model's
    gradients are cleared again."""
    batch = shard_batch(next(iter(trainer.loader)), trainer.dims)
    trainer.executor.forward_backward([batch], forward_done=lambda: None)
    grads = whole_model(trainer, lambda p: p.grad)
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads


@contextlib.contextmanager
def layout_training(argv: Sequence[str], info: RankInfo, device: torch.device
                    ) -> Iterator[Trainer]:
    """A trainer for `loom train` flags in the already initialised process group, inside
    its run's settings (`loom.trainer.scoped.training`): the caller trains it (`fit()`) and
    reads what it needs inside the block; it is closed on the way out and the process-wide
    settings restored, so the next layout starts as a fresh process would."""
    with training(parse_args(argv), info, device) as trainer:
        yield trainer
