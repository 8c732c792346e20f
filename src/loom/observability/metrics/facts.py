"""Run facts: derived once per run (batch, parameters, counted FLOPs, the peak) and
recorded in config.json and summary.json, plus where the run ran."""

from __future__ import annotations

import platform
import socket
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loom.config import JobConfig, ModelConfig
from loom.data.cache import default_cache_dir
from loom.numerics.precision import resolve_precision, torch_dtype
from loom.observability import flops
from loom.parallel.mesh import ParallelDims

MFU_KIND = "model FLOPs: forward + backward once, activation recompute not counted"


@dataclass(frozen=True)
class RunFacts:
    """Derived once per run; recorded in config.json and summary.json."""

    global_batch_size: int
    tokens_per_step: int
    parameters: int
    flops_per_step: float
    """Forward + backward FLOPs of the whole model over one global step."""
    flops_per_rank: float
    """This rank's share: its dp slice of the batch, split tp ways."""
    flops_exact: bool
    peak_flops: float
    peak_source: str
    world_size: int
    dp_size: int
    tp: int
    mfu_kind: str = MFU_KIND


def step_flops(cfg: JobConfig, build_model: Callable[[JobConfig], nn.Module]) -> flops.FlopCount:
    """Forward + backward FLOPs of one dp rank's optimizer step (batch x grad accum samples),
    counted on the unparallelized model that `build_model` makes from the config's model
    section: one sample's count times the samples (every operator's FLOPs are linear in the
    batch; tests/unit/test_flops.py checks it)."""
    one = sample_flops(build_model, cfg.model, cfg.data.seq_len)
    return replace(one, flops=one.flops * cfg.train.batch_size * cfg.train.grad_accum_steps)


@lru_cache(maxsize=16)
def sample_flops(build_model: Callable[[JobConfig], nn.Module], model: ModelConfig,
                 seq: int) -> flops.FlopCount:
    """One sample's count, kept per process: the same model at the same sequence length
    counts the same, and `loom verify`, the parity harness and `loom.fit` callers build many
    runs of one model in one process (each count is a forward and backward of the model)."""
    return flops.count_step_flops(lambda: build_model(JobConfig(model=model)), 1, seq)


def run_facts(cfg: JobConfig, dims: ParallelDims, device: torch.device, parameters: int,
              count: flops.FlopCount) -> RunFacts:
    """Global batch, parameters, counted FLOPs (per step and per rank) and the peak."""
    global_batch = dims.global_batch_size(cfg.train.batch_size * cfg.train.grad_accum_steps)
    peak = flops.peak_flops(device, run_dtype(cfg, device), peak_cache(cfg))
    return RunFacts(
        global_batch_size=global_batch, tokens_per_step=global_batch * cfg.data.seq_len,
        parameters=parameters, flops_per_step=count.flops * dims.dp_size,
        flops_per_rank=count.flops / (dims.tp * dims.cp * dims.pp), flops_exact=count.exact,
        peak_flops=peak.flops, peak_source=peak.source, world_size=dims.world_size,
        dp_size=dims.dp_size, tp=dims.tp)


def run_dtype(cfg: JobConfig, device: torch.device) -> torch.dtype:
    return torch_dtype(resolve_precision(cfg.parallel.dtype, device).dtype)


def peak_cache(cfg: JobConfig) -> Path:
    return Path(cfg.data.cache_dir).expanduser() if cfg.data.cache_dir else default_cache_dir()


def environment_facts() -> dict[str, Any]:
    return {"torch": torch.__version__, "python": platform.python_version(),
            "hostname": socket.gethostname()}


def hostnames() -> list[str]:
    """Collective: every rank's hostname, in rank order."""
    names: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return [str(n) for n in names]
