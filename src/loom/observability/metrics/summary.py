"""The run's summary: summary.json (last / mean / min / max / steady-state mean of every
metric, timings, run facts), plots and the closing log lines with a text plot of the loss."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from loom.observability.metrics.rows import is_step_row, read_rows, run_history
from loom.observability.plots import write_plots
from loom.observability.progress import text_plot
from loom.safe_io import write_text_atomic

logger = logging.getLogger("loom")


def steady_start(n_steps: int) -> int:
    """First step of the steady state: a fifth of the run (1..100 steps) is warm-up."""
    return 1 + min(max(n_steps - 1, 0), max(1, min(n_steps // 5, 100)))


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """last / mean / min / max / steady-state mean of every numeric metric."""
    steady_from = steady_start(len(rows))
    out: dict[str, dict[str, float]] = {}
    for key in dict.fromkeys(k for row in rows for k in row):
        values = [row[key] for row in rows if isinstance(row.get(key), (int, float))]
        steady = [row[key] for row in rows
                  if row["train/iter"] >= steady_from and isinstance(row.get(key), (int, float))]
        if values:
            out[key] = {"last": values[-1], "mean": sum(values) / len(values),
                        "min": min(values), "max": max(values),
                        "steady_mean": sum(steady) / len(steady) if steady else values[-1]}
    return out


def write_summary(outdir: Path, facts: dict[str, Any], timings: dict[str, float],
                  stragglers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """summary.json from rank 0's rows as the run stands; plots and closing lines if any.
    `stragglers`: the ranks `loom.runtime.straggler` named (rank, host, step, worst ratio)."""
    rows = run_history(read_rows(outdir / "metrics-0.jsonl", is_step_row))
    summary = {"steps": len(rows), "tokens": rows[-1]["train/tokens_seen"] if rows else 0,
               "steady_from_step": steady_start(len(rows)), "timings": timings, **facts,
               "stragglers": stragglers or [], "metrics": summarize(rows)}
    write_text_atomic(outdir / "summary.json", json.dumps(summary, indent=2) + "\n")
    if rows:
        write_plots(rows, outdir / "plots")
        log_closing(rows, summary, outdir)
    return summary


def log_closing(rows: list[dict[str, Any]], summary: dict[str, Any], outdir: Path) -> None:
    steady = summary["metrics"]
    logger.info("\n".join(text_plot([r["train/loss"] for r in rows], label="loss")))
    logger.info("done: %d steps, %s tokens, loss %.4f -> %.4f; steady %s tok/s, "
                "MFU %.2f%%; setup %.1f s, train %.1f s; run folder %s",
                summary["steps"], f"{summary['tokens']:,}", rows[0]["train/loss"],
                rows[-1]["train/loss"], f"{steady['train/tps']['steady_mean']:,.0f}",
                steady.get("train/mfu", {}).get("steady_mean", float("nan")),
                summary["timings"]["setup_s"], summary["timings"]["train_s"], outdir)
