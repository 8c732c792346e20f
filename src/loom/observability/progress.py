"""What rank 0 shows while training: a steady progress line and, at the end, a text plot.

On a terminal the line is redrawn in place every step and kept every N steps; otherwise
(logs, `loom launch`) one line is logged every N steps, plus the first and the last.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from datetime import timedelta
from typing import Any, TextIO

logger = logging.getLogger("loom")

CADENCES = (1, 2, 5, 10, 20, 50, 100)
MAX_AUTO_LINES = 20


def auto_every(total_steps: int) -> int:
    """The smallest round cadence giving at most ~20 lines (every 100 steps at most)."""
    for every in CADENCES:
        if total_steps <= every * MAX_AUTO_LINES:
            return every
    return CADENCES[-1]


def format_eta(seconds: float) -> str:
    return str(timedelta(seconds=round(max(seconds, 0.0))))


def format_mfu(mfu: float | None) -> str:
    """None: a reading above 100% (a wrong peak or count), never shown as a number."""
    return "  n/a " if mfu is None else f"{mfu:5.2f}%"


MEMORY_KEYS = ("train/mem_alloc_peak", "train/mem_rss_peak")
"""The console's memory figure: peak allocated device memory, or the process's peak RSS."""


def format_memory(row: dict[str, Any]) -> str:
    value = next((row[k] for k in MEMORY_KEYS if k in row), None)
    return "" if value is None else f"  mem {value:5.2f} GiB"


def format_progress(row: dict[str, Any], total: int, eta_s: float) -> str:
    width = len(str(total))
    val = f"  val {row['val/loss']:.4f} ppl {row['val/ppl']:,.1f}" if "val/loss" in row else ""
    val += "".join(f"  {key[:-len('/loss')]} {row[key]:.4f}" for key in row
                   if key.startswith("val/") and key.endswith("/loss") and key != "val/loss")
    return (f"step {row['train/iter']:>{width}}/{total}  loss {row['train/loss']:.4f}{val}  "
            f"{row['train/tps']:>9,.0f} tok/s  mfu {format_mfu(row['train/mfu'])}  "
            f"dt {row['train/dt'] * 1e3:7.1f} ms{format_memory(row)}  eta {format_eta(eta_s)}")


class Progress:
    """Progress of one run on rank 0 (`enabled=False` elsewhere)."""

    def __init__(self, every: int, enabled: bool, stream: TextIO | None = None):
        self.requested, self.enabled = every, enabled
        self.stream = stream or sys.stdout
        self.total, self.start, self.every, self.t0 = 0, 0, 1, time.perf_counter()

    def begin(self, total_steps: int, start_step: int = 0) -> None:
        """`start_step`: steps already done by the run this one resumes."""
        self.total, self.start, self.t0 = total_steps, start_step, time.perf_counter()
        self.every = self.requested or auto_every(total_steps - start_step)

    def due(self, step: int) -> bool:
        """A logging step: its line is kept (the same answer on every rank, enabled or not)."""
        return step == 1 or step == self.total or step % self.every == 0

    def update(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = row["train/iter"]
        done = max(1, step - self.start)
        eta = (time.perf_counter() - self.t0) / done * (self.total - step)
        line = format_progress(row, self.total, eta)
        keep = self.due(step)
        if self.stream.isatty():
            self.stream.write("\r\x1b[2K" + line + ("\n" if keep else ""))
            self.stream.flush()
        elif keep:
            logger.info(line)


def _resample(values: list[float], width: int) -> list[float]:
    """Mean of each of `width` equal slices (or the values themselves when fewer)."""
    if len(values) <= width:
        return values
    edges = [round(i * len(values) / width) for i in range(width + 1)]
    return [sum(values[a:b]) / (b - a) for a, b in itertools.pairwise(edges)]


def text_plot(values: list[float], label: str, height: int = 8, width: int = 60) -> list[str]:
    """A small ASCII chart of a series (e.g. the loss per step), one '*' per column."""
    finite = [v for v in values if v == v and abs(v) != float("inf")]
    if not finite:
        return [f"{label}: no finite values"]
    cols = _resample(values, width)
    lo, hi = min(finite), max(finite)
    span = (hi - lo) or 1.0
    grid = [[" "] * len(cols) for _ in range(height)]
    for x, v in enumerate(cols):
        if v == v and abs(v) != float("inf"):
            grid[height - 1 - round((v - lo) / span * (height - 1))][x] = "*"
    labels = [f"{hi:#.4g}"] + [""] * (height - 2) + [f"{lo:#.4g}"]
    pad = max(len(s) for s in labels)
    lines = [f"{s:>{pad}} |{''.join(row)}".rstrip() for s, row in zip(labels, grid, strict=True)]
    axis = f"{'':>{pad}} +{'-' * len(cols)}"
    return [f"{label} over {len(values)} steps", *lines, axis]
