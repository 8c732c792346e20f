"""Step rows: one JSON line per optimizer step in `metrics-<rank>.jsonl`, the step's clock
and its spread over ranks, and reading the rows back (a resumed run appends, so readers
take `run_history`)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loom.compat import all_gather_flat
from loom.observability import flops
from loom.safe_io import open_append, open_regular

logger = logging.getLogger("loom")


Times = tuple[float, float, float]
"""(dt, dtf, dtb) of one step, in seconds."""


class StepClock:
    """Time of a step, split into data+forward+loss (`dtf`) and backward+optimizer (`dtb`);
    the forward mark may repeat per micro-batch and accumulates. `stop()` returns a callable
    that gives the times when the metrics are read, not before.

    On CUDA the marks are device events, read at the logging step: the step never waits
    for the device to time itself, and dt is the device's time from the step's first mark
    to its last. Elsewhere the marks are host clock readings after a device synchronise
    (a no-op on the CPU, which runs each op to completion): the time is the step's wall time.
    """

    def __init__(self, device: torch.device):
        self.events = device.type == "cuda"
        self.sync = flops.synchronizer(device)
        self.start()

    def start(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.dtf = 0.0
        if self.events:
            self.marks = [self._event()]
            self.forward_marks: list[int] = []

    @staticmethod
    def _event() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _lap(self) -> float:
        self.sync()
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        return elapsed

    def forward_done(self) -> None:
        if self.events:
            self.forward_marks.append(len(self.marks))
            self.marks.append(self._event())
        else:
            self.dtf += self._lap()

    def stop(self) -> Callable[[], Times]:
        """The step's (dt, dtf, dtb), to call when they are read; what follows the last
        forward mark counts as backward."""
        if self.events:
            marks, forward = [*self.marks, self._event()], list(self.forward_marks)
            return lambda: _event_times(marks, forward)
        self._lap()
        dt = self.last - self.t0
        times = (dt, self.dtf, dt - self.dtf)
        return lambda: times


def _event_times(marks: list[torch.cuda.Event], forward: list[int]) -> Times:
    """Waits for the step's last event (already done when read a step or more later)."""
    marks[-1].synchronize()
    dt = marks[0].elapsed_time(marks[-1]) / 1e3
    dtf = sum(marks[i - 1].elapsed_time(marks[i]) for i in forward) / 1e3
    return dt, dtf, dt - dtf


class RowWriter:
    """Appends rows, never truncates: the folder is new, or resumed (see `run_history`)."""

    def __init__(self, path: Path):
        self.file = open_append(path)

    def write(self, row: dict[str, Any]) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


MAX_ROWS_BYTES = 4 << 30
"""Rows read back for the summary: ~8 million steps of ~500 bytes; a larger file is crafted."""
MAX_ROW_BYTES = 1 << 20


def _parsed(line: bytes) -> Any:
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return _BAD


_BAD = object()


def is_step_row(row: Any) -> bool:
    """A JSON object of numbers (or nulls) with an integer `train/iter`."""
    return isinstance(row, dict) and type(row.get("train/iter")) is int and all(
        v is None or type(v) in (int, float) for v in row.values())


def read_rows(path: Path, check: Callable[[Any], bool] = lambda row: True) -> list[Any]:
    """The JSON lines of a file that pass `check` (`is_step_row` for metrics). A resumed run
    folder may come from elsewhere: a link, a FIFO, an endless line or a line that fails
    (a crafted string where a number belongs, bad JSON) is left out with one warning,
    never a traceback at the end of a run."""
    rows, skipped = [], 0
    try:
        with open_regular(path) as f:
            while line := f.readline(MAX_ROW_BYTES + 1):
                if len(line) > MAX_ROW_BYTES or f.tell() > MAX_ROWS_BYTES:
                    raise ValueError("a line or the file is longer than a metrics file's")
                if not line.strip():
                    continue
                row = _parsed(line)
                if row is _BAD or not check(row):
                    skipped += 1
                else:
                    rows.append(row)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        logger.warning("%s: not read further (%s)", path, e)
    if skipped:
        logger.warning("%s: %d lines that are not step rows left out", path, skipped)
    return rows


def run_history(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the run as it stands: a resumed run appends from its checkpoint's step,
    so a row whose step is not past the previous one replaces the rows it repeats."""
    history: list[dict[str, Any]] = []
    for row in rows:
        while history and history[-1]["train/iter"] >= row["train/iter"]:
            history.pop()
        history.append(row)
    return history


TIMING_KEYS = ("train/dt", "train/dtf", "train/dtb")
SPREAD = ("min", "max", "std")


def gather_floats(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's `values`, in rank order: one all-gather, so every rank must call it at
    the same steps (the logging steps)."""
    dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    local = torch.tensor(values, dtype=dtype, device=device)
    gathered = torch.empty(dist.get_world_size() * len(values), dtype=local.dtype, device=device)
    all_gather_flat(gathered, local)
    return gathered.view(-1, len(values)).tolist()


def timing_spread(gathered: list[list[float]]) -> dict[str, float]:
    """min / max / std over every rank of the step's dt, dtf and dtb (`train/dt_min`, ...),
    from the first three columns of `gather_floats`. A slow rank shows as max far above
    min; std says whether it is one rank or all."""
    columns = torch.tensor(gathered, dtype=torch.float64)[:, : len(TIMING_KEYS)]
    stats = torch.stack([columns.amin(0), columns.amax(0), columns.std(0, correction=0)])
    values = stats.tolist()
    return {f"{key}_{name}": values[i][j] for i, name in enumerate(SPREAD)
            for j, key in enumerate(TIMING_KEYS)}
