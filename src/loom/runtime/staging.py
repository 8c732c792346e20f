"""A folder replaced whole (`loom export`, `--save-hf`): one writer at a time, staged beside
it, swapped in, and a crashed swap recovered by the next command.

The steps, for a target `out`:

1. `.out.lock` beside it is locked (`loom.runtime.locks`); a second writer is refused in
   one line naming the first. The lock file goes when the writer is done.
2. Leftovers of a writer that was killed are dealt with: if `out` is missing and
   `.out.old-<pid>-<hex>` exists, the kill came between the two renames of step 5, and
   that folder, the complete previous export, is renamed back to `out`; every other
   `.out.partial-*` and `.out.old-*` is removed.
3. The writer stages in its own `.out.partial-<pid>-<hex>` (never another's).
4. When the export checked itself, loom's marker is written into the staging folder.
5. The swap, with Ctrl-C and SIGTERM held until it ends: the staging folder and `out`
   are exchanged in one step (Linux's `renameat2(RENAME_EXCHANGE)`), the old export, now
   at the staging name, is renamed `.out.old-<pid>-<hex>` and removed. Where the system
   cannot exchange (another OS, an old kernel or libc, a filesystem without it) `out` is
   renamed to `.out.old-...` and the staging folder to `out`: two renames, and a failed
   second one puts the old folder back. A rename refused by the filesystem (a mount point:
   EBUSY; EXDEV) is one line, with `out` as it was.

So a kill at any point leaves `out` holding the previous export or the new one, complete;
only with two renames can a kill fall between them, leaving `out` missing with the
previous one beside it, which step 2 of the next command restores. Names longer than the
filesystem allows are shortened with a digest (`loom.runtime.outputs.short_name`), so a
long target name still has its leftovers found.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import re
import secrets
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from loom.errors import ConfigError
from loom.runtime.locks import release, sign, take_lock
from loom.runtime.outputs import (
    MARKER,
    MARKER_TEXT,
    NAME_MAX,
    check_kind,
    check_not_mount,
    check_replaceable,
    remove_entry,
    short_name,
)
from loom.safe_io import write_text_atomic

logger = logging.getLogger("loom")

TAG_ROOM = 32
"""Bytes kept free after `.<name>` for `.partial-<pid>-<hex>`, `.old-...` and `.lock`."""
HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def prefix(target: Path) -> str:
    """`.<name>`: the start of every name loom puts beside `target`."""
    return "." + short_name(target.name, NAME_MAX - 1 - TAG_ROOM)


def beside(target: Path, kind: str) -> Path:
    """A new name beside `target` for a staging (`partial`) or old (`old`) folder."""
    return target.with_name(f"{prefix(target)}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def lock_path(target: Path) -> Path:
    return target.with_name(f"{prefix(target)}.lock")


def leftovers(target: Path) -> dict[str, list[Path]]:
    """The staging and old folders beside `target` that loom's writers left ({kind: paths})."""
    pattern = re.compile(re.escape(prefix(target)) + r"\.(partial|old)-\d+-[0-9a-f]{8}")
    found: dict[str, list[Path]] = {"partial": [], "old": []}
    try:
        names = sorted(os.listdir(target.parent))
    except (OSError, ValueError):  # no such folder (nothing to recover), a NUL in the path
        return found
    for name in names:
        match = pattern.fullmatch(name)
        if match:
            found[match.group(1)].append(target.parent / name)
    return found


def recover(target: Path, flag: str) -> None:
    """Step 2 (under the lock): restore a target a kill left missing, remove the rest."""
    found = leftovers(target)
    if not os.path.lexists(target) and found["old"]:
        old = found["old"].pop()  # one at most: every swap starts with this step
        os.rename(old, target)
        logger.warning("%s %s: restored the previous folder from an interrupted export "
                       "(%s)", flag, target, old.name)
    for path in found["partial"] + found["old"]:
        remove_entry(path)
        logger.warning("%s %s: removed %s, left by an interrupted export", flag, target,
                       path.name)


def lock_target(target: Path, flag: str) -> IO[str]:
    """Step 1: the held lock beside `target`, signed; one line if another writer holds it
    or the lock file cannot be made."""
    path = lock_path(target)
    try:
        lock = take_lock(path, lambda owner: (
            f"{flag} {target} is being written by another loom command ({owner}); wait "
            "for it or choose another folder"))
    except OSError as e:
        raise ConfigError(f"{flag} {target}: cannot create {path.name} beside it "
                          f"({e.strerror})") from None
    sign(lock)
    return lock


def tidy(target: Path, flag: str) -> None:
    """Steps 1-2 alone, before a command checks `target`: what it checks is what an earlier
    writer meant to leave (a killed one's lock file goes too). Nothing is created when
    there is nothing to recover."""
    if not any(leftovers(target).values()) and not os.path.lexists(lock_path(target)):
        return
    lock = lock_target(target, flag)
    try:
        recover(target, flag)
    finally:
        release(lock, lock_path(target))


@contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM that arrive in the block take effect when it ends, with the
    handlers they had: the renames of a swap are never cut apart by them. (Only the main
    thread can set handlers; elsewhere the block runs unguarded.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda number, frame: caught.append(number))
                for sig in HELD_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        for number in caught[:1]:
            signal.raise_signal(number)


def rename(source: Path, dest: Path, target: Path, flag: str) -> None:
    """os.rename, or one line saying why not (a mount point: EBUSY; across filesystems:
    EXDEV; a name too long)."""
    try:
        os.rename(source, dest)
    except OSError as e:
        hint = "; a mount point cannot be replaced: use a folder inside it" \
            if e.errno in (errno.EBUSY, errno.EXDEV) else ""
        raise ConfigError(f"{flag} {target}: cannot rename {source.name} to {dest.name} "
                          f"({e.strerror}); {target} was left as it was{hint}") from None


AT_FDCWD, RENAME_EXCHANGE = -100, 2
"""renameat2's "relative to the working folder" and "swap the two" (linux/fcntl.h, fs.h)."""


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    """libc's renameat2 (glibc 2.28+), or None where there is none."""
    try:
        found = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except OSError:
        return None
    if found is not None:
        found.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    return found


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing entries in one step, so that a reader or a kill sees one or the
    other at each name, never neither; False where the system cannot (the caller renames
    twice)."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    number = ctypes.get_errno()
    if number in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # kernel or filesystem
        return False
    raise OSError(number, os.strerror(number), os.fspath(b))


def swapped(staging: Path, target: Path, flag: str) -> bool:
    """`exchange`, or one line saying why the filesystem refused it (as `rename`)."""
    try:
        return exchange(staging, target)
    except OSError as e:
        hint = "; a mount point cannot be replaced: use a folder inside it" \
            if e.errno in (errno.EBUSY, errno.EXDEV) else ""
        raise ConfigError(f"{flag} {target}: cannot exchange it with {staging.name} "
                          f"({e.strerror}); {target} was left as it was{hint}") from None


def ready(target: Path, overwrite: bool, flag: str) -> bool:
    """Whether `target` exists, checked again under the lock: what changed since the first
    check (a link, a file, new files, a stranger's folder, a mount) is refused."""
    if not check_kind(target, flag, str(target)):
        return False
    if os.listdir(target) and not overwrite:
        raise ConfigError(f"{flag} {target} is not empty now (another process wrote into it "
                          "since it was checked); nothing was replaced: pass --overwrite to "
                          "replace it whole")
    check_replaceable(target, flag, str(target))
    check_not_mount(target, flag, str(target))
    return True


def swap_in(staging: Path, target: Path, overwrite: bool, flag: str) -> None:
    """Step 5: put the finished `staging` folder at `target`; the old one, if any, is
    renamed aside first and removed after, so none of its files survives."""
    if not ready(target, overwrite, flag):
        rename(staging, target, target, flag)
        return
    old = beside(target, "old")
    with signals_held():
        if swapped(staging, target, flag):  # one step: `target` is never missing
            rename(staging, old, target, flag)  # the old export, named as a leftover
        else:
            rename(target, old, target, flag)
            try:
                rename(staging, target, target, flag)
            except BaseException:
                os.rename(old, target)
                raise
        remove_entry(old)  # unlinks only: quick even for a large export


def remove_empty(folders: list[Path]) -> None:
    """Remove the folders a failed writer made above its target, innermost first; one that
    another process filled meanwhile stays, with those above it."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break


def make_parent(target: Path, flag: str) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag} {target}: cannot create {target.parent} ({e.strerror})") \
            from None


@contextmanager
def one_writer(target: Path, flag: str) -> Iterator[None]:
    """Step 1 alone, for a folder written into rather than replaced (`loom tokenize`'s
    OUT, which an interrupted run resumes): the lock beside it, held for the block."""
    make_parent(target, flag)
    lock = lock_target(target, flag)
    try:
        yield
    finally:
        release(lock, lock_path(target))


@contextmanager
def staged(target: Path, overwrite: bool = False, flag: str = "OUTDIR") -> Iterator[Path]:
    """Steps 1-5: a staging folder of this writer's own that replaces `target` when the
    block succeeds; on any failure (Ctrl-C included) it is removed, with the folders above
    `target` this writer made, and `target` is as it was. The lock is held from before the
    block to after the swap."""
    made = [p for p in target.parents if not p.exists()]
    make_parent(target, flag)
    lock, done = lock_target(target, flag), False
    try:
        recover(target, flag)
        ready(target, overwrite, flag)
        staging = beside(target, "partial")
        staging.mkdir()
        try:
            yield staging
            write_text_atomic(staging / MARKER, MARKER_TEXT)
            swap_in(staging, target, overwrite, flag)
            done = True
        finally:
            remove_entry(staging)
    finally:
        release(lock, lock_path(target))
        if not done:
            remove_empty(made)
