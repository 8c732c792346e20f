"""This rank's Trainer for a benchmark, built the way `loom.fit` builds one.

`loom.fit` enters the run's process-wide settings (compiler options, logger levels,
bucketing) around its Trainer (`loom.trainer.scoped.training`); a benchmark that built a
bare Trainer measured a run without them (its `--act-mem-budget`, for one, never reached the
compiler). Each benchmark worker that trains builds its Trainer here instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from loom.config import JobConfig
from loom.runtime.distributed import init_distributed, rank_info, teardown
from loom.trainer.scoped import training
from loom.trainer.trainer import Trainer


@contextlib.contextmanager
def rank_trainer(cfg: JobConfig, cpu_threads: int | None = None) -> Iterator[Trainer]:
    """This rank's Trainer for `cfg` inside the run's settings, in a process group started
    for it; the Trainer is closed and the group torn down however the block ends.
    `cpu_threads` caps the compute threads of a CPU rank (ranks sharing a few cores)."""
    info = rank_info()
    device = init_distributed(info)
    if cpu_threads is not None and device.type == "cpu":
        torch.set_num_threads(cpu_threads)
    try:
        with training(cfg, info, device) as trainer:
            yield trainer
    finally:
        teardown()
