"""A run folder belongs to one run: an exclusive lock, and no silent reuse of an old run.

Rank 0 takes `flock` on `<outdir>/.lock` for the whole run; the kernel releases it when the
process ends, however it ends, so a lock left by a dead run is never in the way. A folder
that already holds a run is refused unless the user says `--resume` (continue it) or
`--overwrite` (move the old run aside). The verdict is decided on rank 0 and shared, so
every rank fails the same way before the dataset and model are built.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
from datetime import datetime
from pathlib import Path
from typing import IO

import torch.distributed as dist

from loom.config import ConfigError

logger = logging.getLogger("loom")

LOCK_NAME = ".lock"
RUN_MARKERS = ("config.json", "summary.json", "checkpoints")


def holds_run(outdir: Path) -> bool:
    """Whether the folder holds what a previous run writes (config, metrics, checkpoints)."""
    if not outdir.is_dir():
        return False
    return any((outdir / name).exists() for name in RUN_MARKERS) or \
        any(outdir.glob("metrics-*.jsonl"))


def take_lock(outdir: Path) -> IO[str]:
    """The open lock file, held until it is closed or the process ends."""
    try:
        outdir.mkdir(parents=True, exist_ok=True)
        lock = (outdir / LOCK_NAME).open("a+")
    except OSError as e:
        raise ConfigError(f"--outdir {outdir}: cannot create the run folder ({e.strerror})") \
            from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        owner = lock.read().strip() or "another process"
        lock.close()
        raise ConfigError(f"--outdir {outdir} is in use by a running job ({owner}); "
                          "wait for it or choose another --outdir") from None
    except OSError as e:  # e.g. a shared filesystem mounted without flock support
        logger.warning("cannot lock %s (%s): two runs into it would not be stopped",
                       outdir / LOCK_NAME, e.strerror)
    return lock


def sign(lock: IO[str]) -> None:
    """Name the owner in the lock file, for the message a second run prints."""
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
    lock.flush()


def move_aside(outdir: Path) -> Path:
    """Move everything but the lock into a sibling folder named after the time."""
    aside = outdir.with_name(f"{outdir.name}.old-{datetime.now():%Y%m%d-%H%M%S-%f}")
    aside.mkdir()
    for entry in outdir.iterdir():
        if entry.name != LOCK_NAME:
            entry.rename(aside / entry.name)
    return aside


def claim(outdir: Path, resume: bool, overwrite: bool) -> tuple[IO[str] | None, str]:
    """Rank 0's decision: (held lock, note to log), or ConfigError."""
    lock = take_lock(outdir)
    note = ""
    if holds_run(outdir) and not resume:
        if not overwrite:
            lock.close()
            raise ConfigError(f"--outdir {outdir} already holds a run; pass --resume to "
                              "continue it, --overwrite to move it aside, or choose another "
                              "--outdir")
        note = f"--overwrite: the previous run in {outdir} was moved to {move_aside(outdir)}"
    sign(lock)
    return lock, note


class RunFolder:
    """The claimed run folder of this job; `close()` releases the lock."""

    def __init__(self, outdir: Path, rank: int, resume: bool, overwrite: bool):
        self.outdir, self.lock, self.created = outdir, None, not outdir.exists()
        verdict: list[str | None] = [None]
        note = ""
        if rank == 0:
            try:
                self.lock, note = claim(outdir, resume, overwrite)
            except ConfigError as e:
                verdict[0] = str(e)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            raise ConfigError(verdict[0])
        self.note = note
        atexit.register(self.close)  # also when setup fails after the claim

    def close(self) -> None:
        """Release the lock; a folder this run created and left empty (setup failed) is
        removed."""
        if self.lock is None:
            return
        if self.created and [p.name for p in self.outdir.iterdir()] == [LOCK_NAME]:
            (self.outdir / LOCK_NAME).unlink()
            self.outdir.rmdir()
        self.lock.close()
        self.lock = None
