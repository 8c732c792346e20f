"""What `Trainer.__init__` builds besides the model: the output folder every rank agrees on,
the host group the stop request travels over, the optimizer steps an epoch holds, the loop
state a checkpoint resumes, and the config as run (config.json). Each is a free function of
what it needs, called once at start-up, so that trainer.py keeps to the loop."""

from __future__ import annotations

import logging
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

from loom.checkpoint.checkpointer import Checkpointer, LoopState
from loom.checkpoint.optimizer import set_optimizer
from loom.checkpoint.resume import ResumePoint, set_aside_later
from loom.config import ConfigError, JobConfig
from loom.data.mixture import check_mixture_state
from loom.data.streaming import StreamLoader, restore_data_state
from loom.numerics.precision import Precision
from loom.observability.metrics import environment_facts
from loom.parallel.mesh import ParallelDims
from loom.runtime.distributed import RankInfo
from loom.trainer.step import StepExecutor

logger = logging.getLogger("loom")


def host_group(world_size: int) -> dist.ProcessGroup | None:
    """A group for host values (the stop request): the default one on gloo, else a gloo
    group beside the accelerator's, whose collectives would wait on the device queue;
    None for one process, which needs none."""
    if world_size == 1:
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


def agree_on_outdir(outdir: str | None, dims: ParallelDims) -> Path:
    """The given folder, or a timestamped one chosen by rank 0 and shared with every rank;
    under --ft-replica-groups each group's own `group-<g>` inside it."""
    if outdir is None:
        chosen = [f"outputs/{datetime.now():%Y-%m-%d-%H%M%S}"]
        dist.broadcast_object_list(chosen, src=0)
        outdir = chosen[0]
    group = f"group-{dims.replica_group}" if dims.replica_groups > 1 else ""
    return Path(outdir) / group


def optimizer_steps_per_epoch(loader: DataLoader | StreamLoader, accum: int) -> int:
    """Each optimizer step takes `accum` loader batches; a ragged remainder is dropped."""
    steps = len(loader) // accum
    if steps == 0:
        raise ConfigError(
            f"zero full optimizer steps per epoch: {len(loader)} batches per rank "
            f"cannot fill --grad-accum-steps {accum}; lower --grad-accum-steps or "
            "--batch-size, or add data")
    return steps


def maybe_resume(resume: ResumePoint | None, cfg: JobConfig, model: nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: LambdaLR,
                 loader: DataLoader | StreamLoader, checkpointer: Checkpointer, rank: int,
                 global_batch: int, executor: StepExecutor) -> LoopState:
    """Load a checkpoint into model, optimizer, scheduler and the step executor's own
    state; the data position is kept in global samples, so it is exact whenever the
    global batch is unchanged."""
    if resume is None:
        return LoopState()
    path, saved = resume.path, resume.saved
    Checkpointer.load(path, model, optimizer, rank, saved, executor.resumed_state(model))
    scheduler.load_state_dict(saved["scheduler"])
    set_optimizer(optimizer, scheduler, cfg.optim)  # what config.json records, given again or not
    loop = LoopState(step=saved["step"], tokens_seen=saved["tokens_seen"],
                     samples_seen=saved["samples_seen"])
    restore_data_state(loader, saved)
    check_mixture_state(loader.dataset, saved, loop.samples_seen,
                        cfg.checkpoint.resume_new_data)
    if loop.samples_seen % global_batch:
        logger.warning("resuming with global batch %d, which does not divide the %d "
                       "samples consumed: continuing from the last whole step",
                       global_batch, loop.samples_seen)
    logger.info("resumed from %s at step %d", path, loop.step)
    explicit = cfg.checkpoint.resume not in ("auto", "latest")
    if explicit and rank == 0:
        aside = set_aside_later(checkpointer.root.parent, path, loop.step)
        if aside is not None:
            logger.info("--resume %s: the later checkpoints of the branch it leaves "
                        "were moved to %s (--resume auto continues this one)", path.name,
                        aside)
    return loop


def effective_config(cfg: JobConfig, info: RankInfo, dims: ParallelDims, device: torch.device,
                     global_batch: int, precision: Precision, executor: StepExecutor,
                     ) -> dict[str, Any]:
    """config.json: the resolved config and what start-up learned (mesh, layout, precision,
    environment)."""
    return {**cfg.to_dict(), "world_size": info.world_size,
            "mesh": dims.degrees, "device": str(device),
            "global_batch_size": global_batch, "precision": vars(precision),
            **executor.layout(),
            "environment": {**environment_facts(), "restarts": info.restarts}}
