"""The run folder: effective config, one metrics file per rank, one concise line per step."""

from __future__ import annotations

import json
import logging
import platform
import socket
from pathlib import Path
from typing import Any, TextIO

import torch

logger = logging.getLogger("loom")


def environment_facts() -> dict[str, Any]:
    return {"torch": torch.__version__, "python": platform.python_version(),
            "hostname": socket.gethostname()}


class RunWriter:
    """Writes `config.json` (rank 0) and `metrics-<rank>.jsonl` (every rank)."""

    def __init__(self, outdir: Path, rank: int):
        self.outdir, self.rank = outdir, rank
        outdir.mkdir(parents=True, exist_ok=True)
        self._metrics: TextIO = open(outdir / f"metrics-{rank}.jsonl", "w")  # noqa: SIM115

    def write_config(self, config: dict[str, Any]) -> None:
        if self.rank == 0:
            text = json.dumps(config, indent=2, default=str)
            (self.outdir / "config.json").write_text(text + "\n")

    def log_step(self, row: dict[str, Any]) -> None:
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        logger.info(format_step(row))

    def close(self) -> None:
        self._metrics.close()


def format_step(row: dict[str, Any]) -> str:
    return (f"step {row['train/iter']:>5d}  loss {row['train/loss']:.4f}  "
            f"dt {row['train/dt'] * 1e3:7.1f} ms  tok/s {row['train/tps']:,.0f}")
