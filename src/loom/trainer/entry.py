"""`loom train`'s entry points: `main` (what `loom.cli` loads by name once the flags are
checked) sets up the process group and host memory, `run` builds a Trainer, runs its loop and
the --save-hf export after it. Apart from trainer.py, which holds the loop, so that the loop's
module reads as the algorithm; above it, so nothing imports back."""

from __future__ import annotations

import logging

import torch

from loom.checkpoint.checkpointer import Checkpointer
from loom.checkpoint.resume import resume_on_restart
from loom.config import JobConfig
from loom.data.loaders import on_node_leaders
from loom.hf.export import export
from loom.models.resolve import resolve_model
from loom.parallel.mesh import ParallelDims
from loom.runtime.distributed import RankInfo, init_distributed, teardown
from loom.runtime.host_memory import retain_freed_memory
from loom.runtime.watchdog import collective_timeout_s
from loom.trainer.trainer import Trainer

logger = logging.getLogger("loom")


def save_hf(checkpointer: Checkpointer, step: int, cfg: JobConfig, rank: int) -> None:
    """Global rank 0 exports the final checkpoint to <outdir>/hf as `loom export` does;
    the other ranks wait, and a failure ends every rank with rank 0's line."""
    checkpoint = checkpointer.root / f"step-{step}"
    target = checkpointer.root.parent / "hf"

    def write() -> None:
        done = export(checkpoint, target, trust_remote_code=cfg.model.trust_remote_code)
        logger.info("--save-hf: %s -> %s (%s)", checkpoint, target, done)

    on_node_leaders(write, leader=rank == 0)


def run(cfg: JobConfig, info: RankInfo, device: torch.device) -> Trainer:
    """Train one job in an initialised process group; returns the trainer for inspection."""
    trainer = Trainer(cfg, info, ParallelDims.from_config(cfg.parallel, info.world_size), device)
    try:
        trainer.fit()
        if trainer.cfg.checkpoint.save_hf:
            save_hf(trainer.checkpointer, trainer.loop.step, trainer.cfg, trainer.info.rank)
    finally:
        trainer.close()
    return trainer


def main(cfg: JobConfig, info: RankInfo) -> None:
    """Train a validated config (see `loom.cli.run_train`, which checks the flags and the
    mesh before any heavy import or collective)."""
    cfg = resolve_model(resume_on_restart(cfg, info.restarts))
    for warning in cfg.warnings:
        logger.warning(warning)
    device = init_distributed(info, collective_timeout_s(cfg.train.comm_timeout_s))
    if device.type == "cpu" and cfg.train.host_memory == "retain" and retain_freed_memory():
        logger.info("host memory: freed blocks kept for reuse (--host-memory release: glibc's "
                    "default)")
    run(cfg, info, device)
    teardown()  # only after success: a failed rank must exit at once, not wait in a barrier
