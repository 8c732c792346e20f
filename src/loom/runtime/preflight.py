"""Checks of the run's surroundings, made on every rank before anything large is allocated or
anything is written: a mistake the user can fix fails in one line."""

from __future__ import annotations

import os
from pathlib import Path

from loom.config import ConfigError

GiB = 2**30


def check_outdir(outdir: str | None) -> None:
    """The run folder is a folder, or can be made in a writable one."""
    if outdir is None:  # outputs/<timestamp> under the working directory
        outdir = "."
    path = Path(outdir).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"--outdir {outdir}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--outdir {outdir}: cannot write in {existing}")


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_host_fits(needed: int, what: str) -> None:
    """Refuse, before allocating, what would exceed the host's available memory (a crafted
    checkpoint's sizes would otherwise meet the OOM killer, or a MemoryError traceback)."""
    free = available_memory_bytes()
    if free is not None and needed > free:
        raise ConfigError(f"{what} needs ~{needed / GiB:,.1f} GiB of memory, more than the "
                          f"{free / GiB:,.1f} GiB available; nothing was allocated")


def check_model_fits(n_params: int, shards: int, device_bytes: int | None,
                     buffer_bytes: int = 0, frozen: int = 0) -> None:
    """Refuse a model whose fp32 weights, gradients and AdamW states (16 bytes a parameter;
    4 for the `frozen` ones among them, which have neither: LoRA's base), split over the
    `shards` ranks that shard it, and buffers (the RoPE table, whole on every rank) exceed
    the free memory."""
    needed = (16 * (n_params - frozen) + 4 * frozen) / shards + buffer_bytes
    if device_bytes is not None and needed > device_bytes:
        raise ConfigError(
            f"the model has {n_params / 1e6:,.0f}M parameters: weights, gradients and AdamW "
            f"states need ~{needed / GiB:,.1f} GiB per rank, more than the "
            f"{device_bytes / GiB:,.1f} GiB free; lower --vocab-size, --dim or --n-layers, "
            "or shard over more ranks")
