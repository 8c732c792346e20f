"""What loading a checkpoint trusts: a manifest of hashes, and JSON only.

Saves are sealed with the size and xxh3-64 hash of every file (data files are hashed as they
are written). Every load path (`--resume`, `loom eval`, `loom export`, `loom generate`) goes
through `verify_checkpoint` and `loom.checkpoint.format.TensorReader`. Nothing is unpickled:
DCP data files hold raw tensor bytes, their layout is `metadata.json` (checked here: only
tensor entries, stored within this folder's own `__R_0.distcp` files listed in the
manifest), and loop, optimizer hyperparameters and RNG states are JSON.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import xxhash
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata

from loom.checkpoint.format import METADATA, load_metadata
from loom.checkpoint.schema import SchemaError, checked_loop
from loom.config import ConfigError
from loom.safe_io import open_regular, read_json_capped, regular_size, write_text_atomic

MANIFEST = "manifest.json"
SECURE_HASH = "sha256"
"""The cryptographic hash `loom digest` computes per file (xxh3 only detects accidents:
anyone can recompute it after tampering)."""
_CHUNK = 1 << 22
_FILE_NAME = re.compile(r"^(?!\.\.?$)[A-Za-z0-9_.][A-Za-z0-9_.-]{0,200}$")
"""A manifest names files of its own folder only: no separators, no `.` or `..`."""


class UnusableCheckpoint(ConfigError):
    """A checkpoint that is incomplete, corrupt or crafted; the same on every rank."""


def read_metadata(path: Path) -> Metadata:
    """The checkpoint's DCP metadata from its JSON; anything malformed, or not a tensor
    stored in this folder's data files, is an UnusableCheckpoint naming the file."""
    try:
        return load_metadata(path)
    except (OSError, ValueError, RecursionError, OverflowError) as e:
        raise UnusableCheckpoint(f"checkpoint {path} is unsafe: {METADATA} {e}") from None


def file_record(path: Path, secure: bool = False) -> dict[str, Any]:
    """Size and xxh3-64 of a file, and (`secure`: for `loom digest`) its SHA-256 in hex."""
    digest, sha, size = xxhash.xxh3_64(), hashlib.sha256(), 0
    with open_regular(path) as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            if secure:
                sha.update(chunk)
            size += len(chunk)
    record: dict[str, Any] = {"bytes": size, "xxh3": digest.intdigest()}
    if secure:
        record[SECURE_HASH] = sha.hexdigest()
    return record


class _HashingStream(io.RawIOBase):
    """A write stream that hashes what passes through it (DCP writes each file in order)."""

    def __init__(self, raw: Any):
        super().__init__()
        self.raw, self.digest, self.size = raw, xxhash.xxh3_64(), 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.digest.update(b)
        self.size += memoryview(b).nbytes
        return self.raw.write(b)

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()


class HashingFileSystem(FileSystem):
    """DCP's local file system that records each written file's size and hash in
    `records`, so a save is sealed without reading its data back."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[str, dict[str, int]] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as raw:
            if mode != "wb":
                yield raw
                return
            stream = _HashingStream(raw)
            yield stream
        self.records[Path(path).name] = {"bytes": stream.size, "xxh3": stream.digest.intdigest()}


def write_manifest(folder: Path, known: dict[str, Any], **fields: Any) -> None:
    """Sizes and xxh3 hashes of every file in the folder (`known`: those the writing ranks
    already computed), written last: the save's seal."""
    files = {p.name: known.get(p.name) or file_record(p) for p in sorted(folder.iterdir())
             if p.name != MANIFEST}
    write_text_atomic(folder / MANIFEST, json.dumps({**fields, "files": files}, indent=1))


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest as plain JSON; UnusableCheckpoint if it is missing or malformed."""
    try:
        manifest = read_json_capped(path / MANIFEST)
        files = manifest["files"]
        if not isinstance(files, dict) or not all(
                isinstance(v, dict) and type(v.get("bytes")) is int and v["bytes"] >= 0
                and type(v.get("xxh3")) is int and set(v) == {"bytes", "xxh3"}
                for v in files.values()):
            raise ValueError("bad file record")
        if not all(_FILE_NAME.match(name) for name in files):
            raise ValueError("a file name is not a plain name in the folder")
    except FileNotFoundError:
        raise UnusableCheckpoint(f"checkpoint {path} has no {MANIFEST}: not a complete loom "
                                 "checkpoint") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UnusableCheckpoint(f"checkpoint {path} is corrupt: {MANIFEST} is unreadable "
                                 f"({e})") from None
    return manifest


def file_problems(path: Path, manifest: dict[str, Any], names: list[str]) -> list[str]:
    """Which of `names` are missing or differ from the manifest."""
    problems = []
    for name in names:
        expected, file = manifest["files"][name], path / name
        try:
            size = regular_size(file)
            if size != expected["bytes"]:
                problems.append(f"{name} has {size} bytes, expected {expected['bytes']}")
            elif file_record(file)["xxh3"] != expected["xxh3"]:
                problems.append(f"{name} checksum mismatch")
        except FileNotFoundError:
            problems.append(f"{name} is missing")
        except ValueError as e:  # a link, a FIFO, a directory
            problems.append(str(e))
        except OSError as e:
            problems.append(f"{name} is unreadable ({e.strerror})")
    return problems


def verify_checkpoint(path: Path, rank: int = 0, world: int = 1,
                      gather: Any = None) -> dict[str, Any]:
    """Check every file against the manifest (rank r reads files r, r+world, ...; `gather`
    shares the findings so every rank raises the same error), then the metadata's safety.
    Returns the manifest."""
    manifest = read_manifest(path)
    names = sorted(manifest["files"])
    problems = file_problems(path, manifest, names[rank::world])
    if gather is not None:
        problems = gather(problems)
    if problems:
        raise UnusableCheckpoint(f"checkpoint {path.name} is corrupt: {problems[0]}")
    for name in [METADATA, "loop.json"]:
        if name not in manifest["files"]:
            raise UnusableCheckpoint(f"checkpoint {path} is corrupt: {name} not in {MANIFEST}")
    for stored in read_metadata(path).storage_data.values():
        record = manifest["files"].get(stored.file)
        if record is None:
            raise UnusableCheckpoint(f"checkpoint {path} is unsafe: {METADATA} points at "
                                     f"{stored.file}, which is not in {MANIFEST}")
        if stored.offset + stored.length > record["bytes"]:
            raise UnusableCheckpoint(f"checkpoint {path} is unsafe: {METADATA} reads past "
                                     f"the end of {stored.file}")
    return manifest


def read_json(path: Path, name: str) -> dict[str, Any]:
    """A JSON object from a regular file of the checkpoint, its size capped."""
    try:
        value = read_json_capped(path / name)
    except (OSError, ValueError) as e:
        raise UnusableCheckpoint(f"checkpoint {path} is corrupt: {name} ({e})") from None
    if not isinstance(value, dict):
        raise UnusableCheckpoint(f"checkpoint {path} is corrupt: {name} is not an object")
    return value


def read_loop(path: Path) -> dict[str, Any]:
    """loop.json, checked against `loom.checkpoint.schema` before anything reads it."""
    loop = read_json(path, "loop.json")
    try:
        loop = checked_loop(loop)
    except SchemaError as e:
        raise UnusableCheckpoint(f"checkpoint {path} is unsafe: loop.json {e}") from None
    return loop
