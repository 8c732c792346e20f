"""The folders a command writes its results into (`loom export`, `--save-hf`, `loom eval`,
`loom tokenize`): checked before any work.

A folder given on the command line may be a link (a write would land where it points), a
file, a folder holding an earlier export (whose files would survive beside the new ones:
an old `model.safetensors` beside new shards is what `from_pretrained` then loads), the
very run, checkpoint or base model the command reads, or someone's project that
`--overwrite` would delete. Each is one line before anything is loaded. How a folder is
replaced whole (one writer, staged beside it, swapped in) is `loom.runtime.staging`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from collections.abc import Sequence
from pathlib import Path

from loom.errors import ConfigError
from loom.safe_io import describe_kind, read_json_capped

MARKER = ".loom-export"
"""Written into every folder `loom export` (and `--save-hf`) writes: only a folder holding
it, or nothing, is replaced by `--overwrite`."""
MARKER_TEXT = "written by loom export: loom export --overwrite replaces this folder whole\n"
NAME_MAX = 255
"""The longest file name, in bytes, of the filesystems loom writes on."""


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
    if exists and not (overwrite or nonempty_ok) and os.listdir(target):
        raise ConfigError(f"{flag} {shown} is not empty (it holds {holds(target)}); pass "
                          "--overwrite to replace it whole, or choose another folder")
    check_writable_parent(target, flag, shown)
    return target


def short_name(name: str, room: int) -> str:
    """`name`, or when its UTF-8 is longer than `room` bytes its start and a digest of the
    whole (`<start>~<8 hex>`): a name derived from a long one (`.<name>.partial-...`,
    `<name>.old-...`) still fits NAME_MAX, and two long names never share one."""
    raw = os.fsencode(name)
    if len(raw) <= room:
        return name
    digest = hashlib.sha256(raw).hexdigest()[:8]
    head = raw[:max(room - 9, 0)].decode("utf-8", errors="ignore")
    return f"{head}~{digest}"


def holds(target: Path) -> str:
    """'model.safetensors and 3 more': what a non-empty folder holds, for a refusal."""
    entries = sorted(os.listdir(target))
    more = f" and {len(entries) - 1} more" if len(entries) > 1 else ""
    return f"{entries[0]}{more}"


def made_by_export(folder: Path) -> bool:
    """Whether `loom export` wrote `folder`: its marker is a regular file, or (an export of
    a loom older than the marker) its generation_config.json says transformers_version
    "loom"."""
    if (folder / MARKER).is_file() and not (folder / MARKER).is_symlink():
        return True
    try:
        config = read_json_capped(folder / "generation_config.json", 1 << 16)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("transformers_version") == "loom"


def check_replaceable(target: Path, flag: str, shown: str) -> None:
    """`--overwrite` replaces an empty folder or an export, never anything else (a project
    with `.git/` and `src/`, a model folder from elsewhere): one line naming it."""
    if not target.is_dir() or not os.listdir(target) or made_by_export(target):
        return
    raise ConfigError(f"{flag} {shown} is not a loom export (no {MARKER}; it holds "
                      f"{holds(target)}): --overwrite replaces only a folder loom exported; "
                      "choose another folder, or remove it yourself")


def check_not_mount(target: Path, flag: str, shown: str) -> None:
    """A mount point cannot be renamed (EBUSY), nor a folder moved out of it to a sibling
    (EXDEV): a folder replaced whole is never one."""
    if target.is_dir() and os.path.ismount(target):
        raise ConfigError(f"{flag} {shown} is a mount point, which loom cannot replace whole "
                          "(it writes beside the folder and renames); use a folder inside it")


def remove_entry(path: Path) -> None:
    """Remove a file, a link (never its target) or a folder tree at `path`, if present."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
