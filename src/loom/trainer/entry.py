"""Training's entry points: `fit` (`loom.fit`, and `loom train`, which `loom.cli` loads by
name once the flags are checked and which maps its exceptions to exit codes) checks the
job, starts the process group if none is up and tears it down after, and returns what the
run ended with; `run` builds a Trainer inside its run's settings, runs its loop and the
--save-hf export after it. Apart from trainer.py, which holds the loop, so that the loop's
module reads as the algorithm; above it, so nothing imports back."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loom.checkpoint.checkpointer import Checkpointer
from loom.config import JobConfig
from loom.config.given import fit_config
from loom.data.loaders import on_node_leaders
from loom.hf.export import export
from loom.observability.metrics import read_rows
from loom.observability.tracking import TENSORBOARD_DIR
from loom.parallel.mesh import ParallelDims
from loom.runtime.distributed import RankInfo, in_current_group, process_group, rank_info
from loom.runtime.host_memory import retain_freed_memory
from loom.runtime.logs import log_output
from loom.runtime.outputs import check_not_mount, check_replaceable, output_folder
from loom.runtime.preflight import check_outdir
from loom.runtime.watchdog import collective_timeout_s
from loom.trainer.resolve import resolve_model, restarted
from loom.trainer.scoped import training
from loom.trainer.trainer import Trainer

logger = logging.getLogger("loom")


SAVE_HF = "--save-hf folder"


def check_run_entries(cfg: JobConfig) -> None:
    """The folders a run writes in its run folder (--save-hf's `hf/`, which it replaces
    after training; --profile's and --tensorboard's) are checked before it: a link or a
    file there is one line now, not a traceback later."""
    if not cfg.output.outdir:
        return  # a new outputs/<time> folder: nothing there yet
    entries = {SAVE_HF: ("hf", cfg.checkpoint.save_hf),
               "--profile folder": ("profile", cfg.output.profile),
               "--tensorboard folder": (TENSORBOARD_DIR, cfg.output.tensorboard)}
    for flag, (name, used) in entries.items():
        if used:  # hf/ is replaced whole: it must be an export; the others are written into
            target = output_folder(Path(cfg.output.outdir) / name, flag,
                                   overwrite=flag == SAVE_HF, nonempty_ok=flag != SAVE_HF)
            if flag == SAVE_HF:
                check_replaceable(target, flag, str(target))
                check_not_mount(target, flag, str(target))


def save_hf(checkpointer: Checkpointer, step: int, cfg: JobConfig, rank: int) -> None:
    """Global rank 0 exports the final checkpoint to <outdir>/hf as `loom export` does;
    the other ranks wait, and a failure ends every rank with rank 0's line."""
    checkpoint = checkpointer.root / f"step-{step}"
    target = checkpointer.root.parent / "hf"

    def write() -> None:
        done = export(checkpoint, target, trust_remote_code=cfg.model.trust_remote_code,
                      overwrite=True, flag=SAVE_HF)  # the run's own hf/, replaced whole
        logger.info("--save-hf: %s -> %s (%s)", checkpoint, target, done)

    on_node_leaders(write, leader=rank == 0)


def run(cfg: JobConfig, info: RankInfo, device: torch.device,
        dims: ParallelDims | None = None) -> Trainer:
    """Train one job in an initialised process group; returns the (closed) trainer for
    inspection. `dims`: the layout `fit` checked (None: built from `cfg`)."""
    with training(cfg, info, device, dims) as trainer:
        trainer.fit()
        if trainer.cfg.checkpoint.save_hf:
            save_hf(trainer.checkpointer, trainer.loop.step, trainer.cfg, trainer.info.rank)
    return trainer


@dataclass(frozen=True)
class FitResult:
    """What a run ended with, on this rank."""

    step: int
    """The last optimizer step taken (a resumed run counts on from its checkpoint)."""
    losses: dict[int, float]
    """Training loss per step of this run, from this rank's metrics rows (every rank logs
    the all-reduced loss); empty under --no-metrics."""
    outdir: Path
    """The run folder: config.json, metrics, summary.json, plots, checkpoints."""
    summary: dict[str, Any] | None
    """summary.json as rank 0 wrote it; None on other ranks and under --no-metrics."""


def result_of(trainer: Trainer) -> FitResult:
    outdir, rank = trainer.metrics.outdir, trainer.info.rank
    rows = read_rows(outdir / f"metrics-{rank}.jsonl") \
        if (outdir / f"metrics-{rank}.jsonl").is_file() else []
    summary = outdir / "summary.json"
    return FitResult(trainer.loop.step,
                     {r["train/iter"]: r["train/loss"] for r in rows if "train/loss" in r},
                     outdir, json.loads(summary.read_text()) if rank == 0
                     and summary.is_file() else None)


def fit(config: JobConfig | Sequence[str]) -> FitResult:
    """Train a job: a JobConfig (`loom.config.parse_args([...])`) or `loom train`'s flags as
    a list. Errors are raised, never turned into an exit (`loom.errors`: ConfigError for bad
    input, NonFiniteLossError, Preempted, ...). The process group is started if none is up
    (one process: gloo, world size 1, or the launcher's environment) and torn down after,
    after a failure too in one process (`abandon` says why not with several); a group the
    caller started is used and left up. Compiler options and
    logger levels the run sets are restored after it. Progress goes to stdout (rank 0)
    unless the `loom` logger has handlers of the caller's own."""
    cfg = fit_config(config)
    info = in_current_group(rank_info())
    owned = not logging.getLogger("loom").handlers
    with log_output(info.rank) if owned else contextlib.nullcontext():
        check_outdir(cfg.output.outdir)
        check_run_entries(cfg)
        cfg = resolve_model(restarted(cfg, info.restarts))  # may reset --tp (HF)
        dims = ParallelDims.from_config(cfg.parallel, info.world_size)  # once, no collective
        for warning in cfg.warnings:
            logger.warning(warning)
        with process_group(info, collective_timeout_s(cfg.train.comm_timeout_s)) as (
                info, device):
            if device.type == "cpu" and cfg.train.host_memory == "retain" \
                    and retain_freed_memory():
                logger.info("host memory: freed blocks kept for reuse (--host-memory release: "
                            "glibc's default)")
            # The trainer is dropped before the group goes: its model and FSDP state sit in
            # reference cycles holding collective handles (see `teardown`).
            return result_of(run(cfg, info, device, dims))
