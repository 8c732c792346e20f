"""One Trainer's life inside its run's process-wide settings.

`run_settings` is the one place that collects what a run sets process-wide (compiler
options, fp32 matmul precision, logger levels, warning filters) from its config; `training`
enters them around the Trainer's build, everything the caller does with it, and its close,
and restores them after, however that ends. Every caller that builds a Trainer goes through
it: `loom train` and `loom.fit`, each of `loom verify`'s layouts, `loom eval`, the parity
tests' workers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from loom.config import JobConfig
from loom.numerics.precision import matmul_settings
from loom.parallel.compile import compiler_settings
from loom.parallel.mesh import ParallelDims
from loom.parallel.simple_fsdp import bucketing_settings
from loom.runtime.distributed import RankInfo
from loom.runtime.logs import log_settings
from loom.runtime.scope import GlobalSettings, applied
from loom.trainer.resolve import resolve_model
from loom.trainer.trainer import Trainer


def run_settings(cfg: JobConfig, device_type: str) -> GlobalSettings:
    """Everything one run of `cfg` sets process-wide. The parallel settings it reads are
    final before the Trainer resolves the rest (resume and start-up change none of them)."""
    return (log_settings(cfg.output.verbose) | compiler_settings(cfg.parallel)
            | bucketing_settings(cfg.parallel, device_type)
            | matmul_settings(device_type))


@contextlib.contextmanager
def training(cfg: JobConfig, info: RankInfo, device: torch.device,
             dims: ParallelDims | None = None) -> Iterator[Trainer]:
    """A Trainer for `cfg` in the initialised process group, closed on the way out. The
    run's settings stay in force for the whole block: compiled graphs are built at the
    first step, and read the compiler options then. `dims`: the run's layout, where the
    caller checked it before starting the group, with the model resolved (else both are
    done here, once: the model first, since transformers' module changes the layout)."""
    if dims is None:
        cfg = resolve_model(cfg)
        dims = ParallelDims.from_config(cfg.parallel, info.world_size)
    with applied(run_settings(cfg, device.type)):
        trainer = Trainer(cfg, info, dims, device)
        try:
            yield trainer
        finally:
            trainer.close()
