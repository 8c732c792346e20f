"""Step rows: one JSON line per optimizer step in `metrics-<rank>.jsonl`, the step's clock,
and reading the rows back (a resumed run appends, so readers take `run_history`)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from loom import flops
from loom.safe_io import open_append


class StepClock:
    """Device-synchronised time of a step, split into data+forward+loss (`dtf`) and
    backward+optimizer (`dtb`); the forward mark may repeat per micro-batch and accumulates."""

    def __init__(self, device: torch.device):
        self.sync = flops.synchronizer(device)
        self.start()

    def start(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.dtf = 0.0

    def _lap(self) -> float:
        self.sync()
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        return elapsed

    def forward_done(self) -> None:
        self.dtf += self._lap()

    def stop(self) -> tuple[float, float, float]:
        """(dt, dtf, dtb); what follows the last forward mark counts as backward."""
        self._lap()
        dt = self.last - self.t0
        return dt, self.dtf, dt - self.dtf


class RowWriter:
    """Appends rows, never truncates: the folder is new, or resumed (see `run_history`)."""

    def __init__(self, path: Path):
        self.file = open_append(path)

    def write(self, row: dict[str, Any]) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def run_history(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the run as it stands: a resumed run appends from its checkpoint's step,
    so a row whose step is not past the previous one replaces the rows it repeats."""
    history: list[dict[str, Any]] = []
    for row in rows:
        while history and history[-1]["train/iter"] >= row["train/iter"]:
            history.pop()
        history.append(row)
    return history
