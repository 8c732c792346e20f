"""File access for folders that came from someone else: run folders, checkpoints, shards.

Every file in a downloaded run folder or checkpoint is input from a stranger, so a name in
it may be a symbolic link (a write would land outside the folder), a FIFO (an open would
wait forever), a directory, or a 64 GB sparse file (a whole read would exhaust memory).
Readers here accept regular files only and read at most a stated number of bytes; writers
never follow a link: JSON goes to a new temporary name in the same folder and is renamed
over the target (`os.replace` replaces a link, never its target), appends open with
O_NOFOLLOW.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import IO, Any

MAX_JSON_BYTES = 64 << 20
"""The largest JSON file loom reads from a checkpoint or run folder (a 100-layer model's
metadata.json is ~1 MB; a 64 MB file is crafted or damaged)."""
_NO_FOLLOW = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def describe_kind(mode: int) -> str:
    """'a symbolic link', 'a FIFO', ... for the one-line refusal."""
    kinds = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
             (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def regular_size(path: Path, follow: bool = False) -> int:
    """The size of `path` if it is a regular file (a link is not followed unless `follow`:
    a path the user typed may be one); else ValueError naming what it is
    (FileNotFoundError if absent)."""
    mode = os.stat(path) if follow else os.lstat(path)
    if not stat.S_ISREG(mode.st_mode):
        raise ValueError(f"{path.name} is {describe_kind(mode.st_mode)}, not a regular file")
    return mode.st_size


def open_regular(path: Path, follow: bool = False) -> IO[bytes]:
    """`path` opened for reading; never a link unless `follow`, and O_NONBLOCK so that a
    FIFO swapped in after the check cannot block the open (the fstat then refuses it)."""
    regular_size(path, follow)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags if follow else flags | _NO_FOLLOW)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{path.name} is {describe_kind(mode)}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes_capped(path: Path, limit: int, follow: bool = False) -> bytes:
    """A regular file's bytes, refused (ValueError) when it holds more than `limit` (a FIFO
    or a device is refused at once, never read: it would block or never end)."""
    size = regular_size(path, follow)
    if size > limit:
        raise ValueError(f"{path.name} has {size:,} bytes, more than the {limit:,} allowed")
    with open_regular(path, follow) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path.name} is larger than the {limit:,} bytes allowed")
    return data


def read_json_capped(path: Path, limit: int = MAX_JSON_BYTES) -> Any:
    """A regular file's JSON; OSError or ValueError (deep nesting included) if unusable."""
    text = read_bytes_capped(path, limit)
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{path.name} nests too deeply") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path.name} is not UTF-8 ({e.reason})") from None


def json_depth(value: Any, limit: int) -> int:
    """How deeply `value` nests lists and objects, counted up to just past `limit`
    (iterative: a deep one cannot overflow the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            if level > limit:
                return level
            stack.extend((v, level + 1) for v in (item.values() if isinstance(item, dict)
                                                  else item))
    return deepest


def write_text_new(path: Path, text: str) -> Path:
    """Write `text` at `path` or, when that name is taken, at `<stem>.1<suffix>`, `.2`, ...:
    never replacing a file (`os.link` refuses an existing name, a link included). Returns
    the path written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write_bytes_atomic(tmp, text.encode())
    try:
        for n in range(10_000):
            candidate = path if n == 0 else path.with_name(f"{path.stem}.{n}{path.suffix}")
            try:
                os.link(tmp, candidate, follow_symlinks=False)
                return candidate
            except FileExistsError:
                continue
        raise FileExistsError(f"{path} and 10,000 numbered names beside it exist")
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write a new file next to `path` (O_EXCL: never an existing name or a link), then
    rename it over `path`: readers see the old or the new file, and a link at `path` is
    replaced, never written through."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW
    try:
        fd = os.open(tmp, flags, 0o644)
    except FileExistsError:  # left by a killed process of the same pid, or planted: the
        tmp.unlink()  # name (a link included, never its target) goes, and O_EXCL again
        fd = os.open(tmp, flags, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def open_append(path: Path) -> IO[str]:
    """`path` opened for appending text, created if absent; a link is refused (ELOOP)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NO_FOLLOW, 0o644)
    return os.fdopen(fd, "a")


def open_lock_file(path: Path) -> IO[str]:
    """The lock file, opened read-write and created if absent; a link is refused (ELOOP)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | _NO_FOLLOW, 0o644)
    return os.fdopen(fd, "a+")
