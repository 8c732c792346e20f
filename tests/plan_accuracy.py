"""Predicted vs measured per-rank peak for a list of configurations (benchmark and tests).

Measured: real gloo ranks run `tests.plan_measure` (FSDPMemTracker around the second
`Trainer.train_step`); the worst rank counts. Predicted: `predict_memory` in this process
under a fake process group of the same size (CPU: no analytic term is added).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from loom.config import parse_args
from loom.config.resolved import settled
from loom.losses import loss_impl_for
from loom.plan.peaks import predict_memory
from loom.plan.trace import fake_world

MiB = 2**20


@dataclass(frozen=True)
class Comparison:
    ranks: int
    flags: list[str]
    predicted_mib: float
    measured_mib: float

    @property
    def error(self) -> float:
        return self.predicted_mib / self.measured_mib - 1


def measured_peaks(stdouts: list[str], n_runs: int) -> list[float]:
    """The worst rank's measured total (MiB) of each run, from the ranks' MEASURED lines."""
    worst = [0.0] * n_runs
    for out in stdouts:
        for line in out.splitlines():
            if line.startswith("MEASURED "):
                record = json.loads(line[len("MEASURED "):])
                worst[record["run"]] = max(worst[record["run"]],
                                           sum(record["peak"].values()) / MiB)
    return worst


def predicted_peak(flags: list[str], ranks: int) -> float:
    cfg = parse_args(flags)
    cfg = settled(cfg, loss_impl=loss_impl_for(cfg))
    with fake_world(ranks):
        return predict_memory(cfg, ranks, "cpu").peak_gib * 1024


def compare(ranks: int, runs: list[list[str]], stdouts: list[str]) -> list[Comparison]:
    measured = measured_peaks(stdouts, len(runs))
    return [Comparison(ranks, flags, predicted_peak(flags, ranks), m)
            for flags, m in zip(runs, measured, strict=True)]
