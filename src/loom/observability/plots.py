"""PNG plots of a run (loss vs tokens, throughput, MFU, memory, per-rank step time), drawn
with matplotlib's object API on the Agg canvas, so no GUI backend or global pyplot state is
touched."""

from __future__ import annotations

import io
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from loom.safe_io import write_bytes_atomic

X_LABELS = {"train/tokens_seen": "tokens seen", "train/iter": "step"}
PLOTS = {  # file: (x key, y keys or key patterns, title, y label)
    "loss.png": ("train/tokens_seen", ("train/loss", "val/loss", "val/*/loss"), "loss", "loss"),
    "throughput.png": ("train/iter", ("train/tps",), "global throughput", "tokens / s"),
    "mfu.png": ("train/iter", ("train/mfu",), "model FLOPs utilisation (rank 0)", "MFU %"),
    "memory.png": ("train/iter", ("train/mem_alloc", "train/mem_alloc_peak",
                                  "train/mem_reserved", "train/mem_reserved_peak",
                                  "train/mem_rss", "train/mem_rss_peak"),
                   "memory (rank 0)", "GiB"),
    "ranks.png": ("train/iter", ("train/rank_dt_max", "train/rank_dt_median",
                                 "train/rank_dt_min"),
                  "step time per rank, waits for other ranks excluded (slowest, median, "
                  "fastest)", "s"),
}


def label(key: str, keys: tuple[str, ...]) -> str:
    """The key without its group (`mem_rss`), unless that is ambiguous (train/val loss)."""
    short = key.split("/")[-1]
    return key if sum(k.split("/")[-1] == short for k in keys) > 1 else short


def plotted_keys(patterns: tuple[str, ...], rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """The keys a plot draws: each plain key, and for a pattern (`val/*/loss`: one curve per
    named validation set) every key of the rows it matches, in the order first seen."""
    seen = dict.fromkeys(k for r in rows for k in r)
    keys: list[str] = []
    for pattern in patterns:
        found = [k for k in seen if fnmatchcase(k, pattern)] if "*" in pattern else [pattern]
        keys += [k for k in found if k not in keys]
    return tuple(keys)


def plot_series(rows: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[Any, Any]]]]:
    """{file: {key: [(x, y), ...]}}: the curves each PNG draws, a key only where a row has
    it (validation rows are the evaluation steps')."""
    series = {}
    for name, (x_key, patterns, _, _) in PLOTS.items():
        curves = {key: [(r[x_key], r[key]) for r in rows if r.get(key) is not None]
                  for key in plotted_keys(patterns, rows)}
        series[name] = {key: points for key, points in curves.items() if points}
    return series


def write_plots(rows: list[dict[str, Any]], folder: Path) -> list[Path]:
    """One PNG per entry of PLOTS (matplotlib imported here: only at the end of a run)."""
    from matplotlib.figure import Figure

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, curves in plot_series(rows).items():
        x_key, patterns, title, y_label = PLOTS[name]
        fig = Figure(figsize=(6, 3.5), dpi=100)
        # fixed margins: matplotlib's constrained layout measured every tick label again and
        # took half of the ~1 s the five figures cost at the end of each run
        fig.subplots_adjust(left=0.13, right=0.97, bottom=0.14, top=0.9)
        ax = fig.subplots()
        keys = tuple(curves)
        for key, points in curves.items():
            ax.plot(*zip(*points, strict=True), label=label(key, keys),
                    marker="." if len(points) < 50 else None)
        ax.set(xlabel=X_LABELS[x_key], ylabel=y_label)
        ax.set_title(title, fontsize="medium")  # ranks.png's title is cut at the default size
        ax.grid(alpha=0.3)
        if len(patterns) > 1 and curves:  # no curves: matplotlib would warn of an empty legend
            ax.legend()
        image = io.BytesIO()
        fig.savefig(image, format="png")
        write_bytes_atomic(folder / name, image.getvalue())
        written.append(folder / name)
    return written
