"""PNG plots of a run (loss vs tokens, throughput, MFU, memory, per-rank step time), drawn
with matplotlib's object API on the Agg canvas, so no GUI backend or global pyplot state is
touched."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from loom.safe_io import write_bytes_atomic

X_LABELS = {"train/tokens_seen": "tokens seen", "train/iter": "step"}
PLOTS = {  # file: (x key, y keys, title, y label)
    "loss.png": ("train/tokens_seen", ("train/loss", "val/loss"), "loss", "loss"),
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


def write_plots(rows: list[dict[str, Any]], folder: Path) -> list[Path]:
    """One PNG per entry of PLOTS (matplotlib imported here: only at the end of a run)."""
    from matplotlib.figure import Figure

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (x_key, y_keys, title, y_label) in PLOTS.items():
        fig = Figure(figsize=(6, 3.5), dpi=100, layout="constrained")
        ax = fig.subplots()
        drawn = 0
        for key in y_keys:
            points = [(r[x_key], r[key]) for r in rows if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), label=label(key, y_keys),
                        marker="." if len(points) < 50 else None)
                drawn += 1
        ax.set(title=title, xlabel=X_LABELS[x_key], ylabel=y_label)
        ax.grid(alpha=0.3)
        if len(y_keys) > 1 and drawn:  # no curves: matplotlib would warn of an empty legend
            ax.legend()
        image = io.BytesIO()
        fig.savefig(image, format="png")
        write_bytes_atomic(folder / name, image.getvalue())
        written.append(folder / name)
    return written
