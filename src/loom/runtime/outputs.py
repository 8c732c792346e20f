"""The folders a command writes its results into (`loom export`, `--save-hf`, `loom eval`,
`loom tokenize`): checked before any work, and replaced whole.

A folder given on the command line may be a link (a write would land where it points), a
file, a folder holding an earlier export (whose files would survive beside the new ones:
an old `model.safetensors` beside new shards is what `from_pretrained` then loads), or the
very run, checkpoint or base model the command reads. Each is one line before anything is
loaded. A folder that is replaced (`--overwrite`) is written beside it and swapped in, so
no file of the old one survives and a failed run leaves the old one as it was.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from loom.errors import ConfigError
from loom.safe_io import describe_kind


def absolute_target(path: Path) -> Path:
    """`path` made absolute with its parent folders resolved and its last part kept as
    written (a link there must be seen, not followed); `.` and `..` resolve whole."""
    path = path.expanduser()
    if path.name in ("", ".", ".."):
        return path.resolve()
    return path.parent.resolve() / path.name


def within(path: Path, folder: Path) -> bool:
    """`path` is `folder` or inside it (both absolute and resolved)."""
    return path == folder or folder in path.parents


def check_kind(target: Path, flag: str, shown: str) -> bool:
    """Whether `target` exists; one line if it is a link or not a folder."""
    try:
        mode = os.lstat(target).st_mode
    except FileNotFoundError:
        return False
    if os.path.islink(target):
        raise ConfigError(f"{flag} {shown} is a symbolic link; loom writes only into real "
                          "folders: pass the folder it points to")
    if not os.path.isdir(target):
        kind = "a file" if stat.S_ISREG(mode) else describe_kind(mode)
        raise ConfigError(f"{flag} {shown} is {kind}, not a folder")
    return True


def check_writable_parent(target: Path, flag: str, shown: str) -> None:
    """The nearest existing folder above `target` is a folder this process can write in."""
    existing = next(p for p in target.parents if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{flag} {shown}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {shown}: cannot write in {existing}")


def output_folder(path: Path | str, flag: str, *, overwrite: bool = False,
                  keep: Sequence[Path] = (), inside: Sequence[Path] = (),
                  nonempty_ok: bool = False) -> Path:
    """The absolute folder a command may write (or replace) at `path`, or one ConfigError
    line: a link, a file, a folder that is or holds one of `keep` (the run, checkpoint or
    model the command reads), a folder inside one of `inside`, or a non-empty folder
    without `overwrite` (unless `nonempty_ok`: the caller writes only new names there)."""
    shown = str(path)
    if not shown:
        raise ConfigError(f"{flag} must not be empty")
    target = absolute_target(Path(path))
    exists = check_kind(target, flag, shown)
    for folder in keep:
        if within(folder.resolve(), target):
            what = "is" if folder.resolve() == target else "holds"
            raise ConfigError(f"{flag} {shown} {what} {folder}, which this command reads; "
                              "choose another folder")
    for folder in inside:
        if within(target, folder.resolve()):
            raise ConfigError(f"{flag} {shown} is inside {folder}; choose a folder outside it")
    if exists and not (overwrite or nonempty_ok):
        entries = sorted(os.listdir(target))
        if entries:
            raise ConfigError(f"{flag} {shown} is not empty (it holds {entries[0]}"
                              f"{f' and {len(entries) - 1} more' if len(entries) > 1 else ''}"
                              "); pass --overwrite to replace it whole, or choose another "
                              "folder")
    check_writable_parent(target, flag, shown)
    return target


def remove_entry(path: Path) -> None:
    """Remove a file, a link (never its target) or a folder tree at `path`, if present."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def swap_in(staging: Path, target: Path, overwrite: bool, flag: str) -> None:
    """Put the finished `staging` folder at `target`: an existing folder (an empty one, or
    any with `overwrite`) is moved aside first and removed after, so none of its files
    survives; what changed since the check (a link, a file, new files) is refused."""
    old = None
    if check_kind(target, flag, str(target)):
        if any(target.iterdir()) and not overwrite:
            raise ConfigError(f"{flag} {target} was filled while loom wrote; nothing was "
                              "replaced (pass --overwrite to replace it whole)")
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        remove_entry(old)
        target.rename(old)
    staging.rename(target)
    if old is not None:
        shutil.rmtree(old)


@contextmanager
def staged(target: Path, overwrite: bool = False, flag: str = "OUTDIR") -> Iterator[Path]:
    """A staging folder beside `target` that replaces it only when the block succeeds (it
    is removed when the block fails): no half-written output, and no stale file."""
    staging = target.with_name(f".{target.name}.partial")
    remove_entry(staging)  # a killed run's, or a planted link (removed, never followed)
    staging.mkdir(parents=True)
    try:
        yield staging
        swap_in(staging, target, overwrite, flag)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
