"""What a run logs to, whether metrics are on or off: where this rank measures and writes
(`RunPlace`), the calls the trainer makes (`RunMetrics`), config.json (`write_config`) and
the no-op (`NullMetrics`, --no-metrics). Apart from the recorder (`recorder.Metrics`) so the
trainer's contract and the overhead baseline read alone; `MAX_QUEUED` is here because the
trainer bounds its own unread queue by it too."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from loom.observability.metrics.facts import hostnames
from loom.parallel.mesh import ParallelDims
from loom.safe_io import write_text_atomic

MAX_QUEUED = 1000
"""Steps whose device values may wait for a read: a run logging rarely (--log-every 10000)
is read every this many steps instead of holding ever more small device tensors."""


@dataclass(frozen=True)
class RunPlace:
    """Where this rank's metrics are measured and written."""

    rank: int
    dims: ParallelDims
    device: torch.device
    outdir: Path
    started: float
    """perf_counter() when the run's setup began: summary.json's setup_s counts from here."""


class RunMetrics(Protocol):
    """What the trainer calls on its metrics, whether they are on or off."""

    outdir: Path

    def write_config(self, config: dict[str, Any]) -> None: ...

    def synced(self) -> None: ...
    def begin(self, total_steps: int, start_step: int = 0, tokens_seen: int = 0,
              input_iter: int = 0) -> None: ...
    def forward_done(self) -> None: ...
    def log_step(self, step: int, epoch: int, bidx: int, loss: torch.Tensor,
                 grad_norm: torch.Tensor, extra: dict[str, float] | None = None, *,
                 valid_tokens: torch.Tensor | None = None,
                 batches: list[dict[str, torch.Tensor]] | None = None,
                 applied: torch.Tensor | None = None,
                 ) -> dict[str, Any] | None: ...
    def flush(self, before: int | None = None) -> dict[str, Any] | None: ...
    def finish(self, extra: dict[str, Any] | None = None) -> None: ...
    def close(self) -> None: ...


def write_config(outdir: Path, rank: int, config: dict[str, Any]) -> list[str]:
    """Collective: every rank adds its hostname; rank 0 writes config.json. Returns the
    hostnames in rank order."""
    names = hostnames()
    if rank == 0:
        text = json.dumps({**config, "hostnames": names}, indent=2, default=str)
        write_text_atomic(outdir / "config.json", text + "\n")
    return names


class NullMetrics:
    """Metrics off: the loop's calls cost nothing; only config.json is written."""

    def __init__(self, outdir: Path, rank: int):
        self.outdir, self.rank = outdir, rank
        outdir.mkdir(parents=True, exist_ok=True)

    def write_config(self, config: dict[str, Any]) -> None:
        write_config(self.outdir, self.rank, config)

    def begin(self, total_steps: int, start_step: int = 0, tokens_seen: int = 0,
              input_iter: int = 0) -> None:
        pass

    def forward_done(self) -> None:
        pass

    def log_step(self, step: int, epoch: int, bidx: int, loss: torch.Tensor,
                 grad_norm: torch.Tensor, extra: dict[str, float] | None = None, *,
                 valid_tokens: torch.Tensor | None = None,
                 batches: list[dict[str, torch.Tensor]] | None = None,
                 applied: torch.Tensor | None = None) -> None:
        return None

    def flush(self, before: int | None = None) -> None:
        return None

    def synced(self) -> None:
        pass

    def finish(self, extra: dict[str, Any] | None = None) -> None:
        pass

    def close(self) -> None:
        pass
