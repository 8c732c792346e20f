"""A run folder belongs to one run: an exclusive lock, and no silent reuse of an old run.

Rank 0 takes `flock` on `<outdir>/.lock` for the whole run; the kernel releases it when the
process ends, however it ends, so a lock left by a dead run is never in the way. A folder
that already holds a run is refused unless the user says `--resume` (continue it) or
`--overwrite` (move the old run aside). The verdict is decided on rank 0 and shared, so
every rank fails the same way before the dataset and model are built.

What is a run folder is decided by loom's own marker file, `.loom-run`, never by a file
name other tools use too (a Hugging Face model folder has a `config.json`): a non-empty
folder without it is refused unless `--adopt-outdir` says to use it, and `--overwrite`
moves only marked folders. Run folders are shared and downloaded, so a symbolic link
among their entries (which a write would follow outside the folder) is refused outright.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
from datetime import datetime
from pathlib import Path
from typing import IO

import torch.distributed as dist

from loom.config import ConfigError
from loom.runtime.locks import sign, take_lock
from loom.runtime.outputs import NAME_MAX, short_name
from loom.runtime.staging import signals_held
from loom.safe_io import write_text_atomic

logger = logging.getLogger("loom")

LOCK_NAME = ".lock"
MARKER = ".loom-run"
"""Written into every folder loom claims as a run folder; its presence makes one."""
MARKER_TEXT = "a loom run folder: loom train --resume continues it, --overwrite moves it\n"
RUN_MARKERS = ("config.json", "summary.json", "checkpoints")
LINK_DEPTH = 3
"""How deep links are looked for: <run>/checkpoints/step-N/<file>, <run>/plots/<file>."""


def holds_run(outdir: Path) -> bool:
    """Whether the folder holds what a previous run writes (config, metrics, checkpoints)."""
    if not outdir.is_dir():
        return False
    return any((outdir / name).exists() for name in RUN_MARKERS) or \
        any(outdir.glob("metrics-*.jsonl"))


def is_run_folder(outdir: Path) -> bool:
    """Whether loom claimed this folder before (its marker is a regular file)."""
    return (outdir / MARKER).is_file() and not (outdir / MARKER).is_symlink()


def first_link(folder: Path, depth: int = LINK_DEPTH) -> Path | None:
    """The first symbolic link among the folder's entries, `depth` levels down (links are
    never followed while looking)."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return None
    for entry in entries:
        if entry.is_symlink():
            return Path(entry.path)
        if depth > 1 and entry.is_dir(follow_symlinks=False):
            found = first_link(Path(entry.path), depth - 1)
            if found is not None:
                return found
    return None


def check_no_links(outdir: Path, flag: str = "--outdir") -> None:
    """One line if the run folder, or an entry in it, is a symbolic link."""
    if outdir.is_symlink():
        raise ConfigError(f"{flag} {outdir} is a symbolic link; loom writes only into real "
                          "folders: pass the folder it points to")
    link = first_link(outdir) if outdir.is_dir() else None
    if link is not None:
        raise ConfigError(f"{flag} {outdir}: {link.relative_to(outdir)} is a symbolic link; "
                          "loom never writes through links in a run folder: remove it or "
                          "choose another folder")


def check_is_ours(outdir: Path, overwrite: bool, adopt: bool) -> None:
    """A non-empty folder without loom's marker is someone else's: one line, unless
    --adopt-outdir; never moved by --overwrite."""
    if not outdir.is_dir() or is_run_folder(outdir):
        return
    if overwrite and holds_run(outdir):
        raise ConfigError(f"--outdir {outdir} is not a loom run folder (no {MARKER}): "
                          "--overwrite moves only loom run folders; choose another --outdir")
    if not adopt and any(p.name != LOCK_NAME for p in outdir.iterdir()):
        raise ConfigError(f"--outdir {outdir} is a non-empty folder that is not a loom run "
                          f"(no {MARKER}); choose a new or empty --outdir, or pass "
                          "--adopt-outdir to use it (so too for a run folder of a loom "
                          "older than the marker)")


def take_run_lock(outdir: Path) -> IO[str]:
    """The open lock file, held until it is closed or the process ends."""
    try:
        outdir.mkdir(parents=True, exist_ok=True)
        return take_lock(outdir / LOCK_NAME, lambda owner: (
            f"--outdir {outdir} is in use by a running job ({owner}); wait for it or "
            "choose another --outdir"))
    except OSError as e:
        raise ConfigError(f"--outdir {outdir}: cannot create the run folder ({e.strerror})") \
            from None


def aside_name(outdir: Path) -> Path:
    """`<name>.old-<time>` beside the run folder (a long name shortened to fit)."""
    suffix = f".old-{datetime.now():%Y%m%d-%H%M%S-%f}"
    return outdir.with_name(short_name(outdir.name, NAME_MAX - len(suffix)) + suffix)


def move_aside(outdir: Path) -> Path:
    """Move everything but the lock into a sibling folder named after the time (the marker
    goes with it, last: a kill midway leaves a folder still marked, which the next
    --overwrite moves on; `claim` marks the new one). A move that fails (the run folder is
    a mount point: EXDEV) is undone: one line, nothing moved."""
    aside = aside_name(outdir)
    entries = sorted((e for e in outdir.iterdir() if e.name != LOCK_NAME),
                     key=lambda e: (e.name == MARKER, e.name))
    moved: list[Path] = []
    with signals_held():  # Ctrl-C never leaves the run split between two folders
        try:
            aside.mkdir()
            for entry in entries:
                entry.rename(aside / entry.name)
                moved.append(entry)
        except OSError as e:
            for entry in moved:
                (aside / entry.name).rename(entry)
            if aside.is_dir():
                aside.rmdir()
            hint = " (it is a mount point: move its run yourself, or choose another " \
                "--outdir)" if e.errno == errno.EXDEV else ""
            raise ConfigError(f"--outdir {outdir}: --overwrite cannot move the previous run "
                              f"to {aside.name} ({e.strerror}); nothing was moved{hint}") \
                from None
    return aside


def claim(outdir: Path, resume: bool, overwrite: bool, adopt: bool = False
          ) -> tuple[IO[str] | None, str]:
    """Rank 0's decision: (held lock, note to log), or ConfigError."""
    if outdir.is_symlink():
        check_no_links(outdir)
    check_is_ours(outdir, overwrite, adopt)  # first: a stranger's big folder is not walked
    check_no_links(outdir)
    lock = take_run_lock(outdir)
    note = ""
    if holds_run(outdir) and not resume:
        if not overwrite:
            lock.close()
            raise ConfigError(f"--outdir {outdir} already holds a run; pass --resume to "
                              "continue it, --overwrite to move it aside, or choose another "
                              "--outdir")
        try:
            aside = move_aside(outdir)
        except ConfigError:
            lock.close()
            raise
        note = f"--overwrite: the previous run in {outdir} was moved to {aside}"
    sign(lock)
    try:
        if not is_run_folder(outdir):
            write_text_atomic(outdir / MARKER, MARKER_TEXT)
    except OSError as e:
        lock.close()
        raise ConfigError(f"--outdir {outdir}: cannot mark it as a run folder "
                          f"({e.strerror})") from None
    return lock, note


class RunFolder:
    """The claimed run folder of this job; `close()` releases the lock."""

    def __init__(self, outdir: Path, rank: int, resume: bool, overwrite: bool,
                 adopt: bool = False):
        self.outdir, self.lock, self.created = outdir, None, not outdir.exists()
        # the folders above it this run makes (outputs/ of outputs/<time>), removed with it
        self.parents = [p for p in outdir.parents if not p.exists()]
        verdict: list[str | None] = [None]
        note = ""
        if rank == 0:
            try:
                self.lock, note = claim(outdir, resume, overwrite, adopt)
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
        removed, with the empty folders above it the run made."""
        if self.lock is None:
            return
        own = {LOCK_NAME, MARKER}
        if self.created and {p.name for p in self.outdir.iterdir()} <= own:
            for name in own:
                (self.outdir / name).unlink(missing_ok=True)
            self.outdir.rmdir()
            for parent in self.parents:  # innermost first; one another run filled stays
                try:
                    parent.rmdir()
                except OSError:
                    break
        self.lock.close()
        self.lock = None
