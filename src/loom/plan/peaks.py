"""The phases that may hold a rank's peak, and the largest of them. Above `plan.memory`
(one traced step, extrapolated in depth) and `plan.pipeline_memory` (each stage's phases, built
on it): the choice between the two needs both."""

from __future__ import annotations

from loom.config import JobConfig
from loom.plan.memory import Breakdown, MemoryPrediction, finish, in_gib, traced
from loom.plan.pipeline_memory import pipeline_phases
from loom.plan.trace import HELD, MICROBATCH


def traced_phases(cfg: JobConfig, world_size: int) -> list[Breakdown]:
    """Every phase of every rank that may hold the peak (pipeline: each stage's rank)."""
    if cfg.parallel.pp > 1:
        return pipeline_phases(cfg, world_size)
    return [b for name, b in traced(cfg, world_size).items() if name not in (MICROBATCH, HELD)]


def predict_memory(cfg: JobConfig, world_size: int, device_kind: str) -> MemoryPrediction:
    """The largest phase; needs `fake_world(world_size)` around it."""
    phases = [finish(in_gib(b), cfg, device_kind) for b in traced_phases(cfg, world_size)]
    return max(phases, key=lambda m: m.peak_gib)
