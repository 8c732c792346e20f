"""One writer at a time: the advisory lock a run folder (`<run>/.lock`) and a folder that
is replaced whole (`.<name>.lock` beside it) are held by.

`flock` is released by the kernel when its process ends, however it ends, so a lock left
by a killed command is never in the way; a second writer is refused at once, naming the
holder the first wrote into the file. A lock file that is removed when its writer is done
(beside an export) could be locked by a latecomer after its removal, so a lock counts only
while the name still leads to the locked file.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

from loom.errors import ConfigError
from loom.safe_io import open_lock_file

logger = logging.getLogger("loom")

ATTEMPTS = 5
"""How often a lock file that was removed under a waiting opener is opened again."""


def still_named(lock: IO[str], path: Path) -> bool:
    """Whether `path` is the file `lock` holds open (not removed or replaced since)."""
    try:
        return os.stat(path, follow_symlinks=False).st_ino == os.fstat(lock.fileno()).st_ino
    except FileNotFoundError:
        return False


def try_lock(path: Path, busy: Callable[[str], str]) -> IO[str] | None:
    """The locked file, None if it was removed before the lock was taken, or ConfigError
    `busy(owner)` when another process holds it."""
    lock = open_lock_file(path)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        owner = lock.read().strip()[:200] or "another process"
        lock.close()
        raise ConfigError(busy(owner)) from None
    except OSError as e:  # e.g. a shared filesystem mounted without flock support
        logger.warning("cannot lock %s (%s): two writers into it would not be stopped",
                       path, e.strerror)
        return lock
    if still_named(lock, path):
        return lock
    lock.close()
    return None


def take_lock(path: Path, busy: Callable[[str], str]) -> IO[str]:
    """The lock file at `path`, created if absent and held until it is closed or the
    process ends; ConfigError `busy(owner)` if another process holds it. OSError if the
    file cannot be created (the caller names the folder)."""
    for _ in range(ATTEMPTS):
        lock = try_lock(path, busy)
        if lock is not None:
            return lock
    raise ConfigError(busy("other processes, starting and ending"))


def sign(lock: IO[str]) -> None:
    """Name the owner in the lock file, for the message a second writer prints."""
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
    lock.flush()


def release(lock: IO[str], path: Path) -> None:
    """Remove the lock file while it is still held (a latecomer that opened it finds the
    name gone and opens a new one), then let go."""
    if still_named(lock, path):
        path.unlink(missing_ok=True)
    lock.close()
