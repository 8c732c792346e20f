"""CUDA caching-allocator snapshots: `--memory-snapshot` and the one written on an
out-of-memory error, both into the run folder, with the one command that views them.

torch offers these only as private functions (`torch.cuda.memory._record_memory_history`,
`_dump_snapshot`), checked against torch 2.13's `torch/cuda/memory.py`; every private call
is in this module, so a torch upgrade that renames them is fixed here alone.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from loom.config import ConfigError
from loom.errors import DeviceOutOfMemory

logger = logging.getLogger("loom")

HISTORY_ENTRIES = 100_000
"""Allocations and frees kept (a ring buffer): a few steps of a large model's, bounded."""
VIEWER = "https://pytorch.org/memory_viz"


def view_command(path: Path) -> str:
    """How to look at a snapshot: the web viewer, or a local HTML timeline."""
    return (f"drop it on {VIEWER}, or: python -m torch.cuda._memory_viz trace_plot {path} "
            f"-o {path.with_suffix('.html')}")


class MemorySnapshots:
    """Records the allocator's history from the start when `after_steps` > 0 and writes
    `memory-snapshot-rank<r>.pickle` after that many steps (or at the end of a shorter run);
    on an out-of-memory error writes `memory-oom-rank<r>.pickle` whatever the flag (with the
    history when it is recorded, else the allocator's segments alone)."""

    def __init__(self, device: torch.device, outdir: Path, rank: int, after_steps: int):
        self.cuda, self.outdir, self.rank = device.type == "cuda", outdir, rank
        self.after_steps, self.recording = after_steps, False
        if after_steps > 0 and not self.cuda:
            raise ConfigError(f"--memory-snapshot records CUDA's caching allocator; this run "
                              f"is on {device.type}: drop the flag (on the CPU, --profile "
                              "--profile-memory records allocations)")
        if after_steps > 0:
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
            self.recording = True

    def dump(self, name: str) -> Path:
        path = self.outdir / f"{name}-rank{self.rank}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        return path

    def stop(self) -> None:
        if self.recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording = False

    def after_step(self, step: int) -> None:
        if self.recording and step >= self.after_steps:
            self.finish()

    def finish(self) -> None:
        """Write the recorded snapshot (if still recording) and stop recording."""
        if not self.recording:
            return
        path = self.dump("memory-snapshot")
        self.stop()
        logger.info("memory snapshot: %s; %s", path, view_command(path))

    def out_of_memory(self, error: BaseException) -> BaseException:
        """What to raise for an out-of-memory error: one line naming the snapshot written
        for it (CUDA), or the error itself where there is no allocator to snapshot."""
        if not self.cuda:
            return error
        try:
            path = self.dump("memory-oom")
        except (OSError, RuntimeError) as e:
            return DeviceOutOfMemory(f"{first_line(error)} (no snapshot: {e})")
        finally:
            self.stop()
        return DeviceOutOfMemory(f"{first_line(error)}; allocator snapshot in {path}: "
                                 f"{view_command(path)}")


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
