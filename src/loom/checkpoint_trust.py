"""What loading a checkpoint trusts: a manifest of hashes, JSON, and exact metadata classes.

Saves are sealed with the size and xxh3-64 hash of every file (data files are hashed as they
are written). Every load path (`--resume`, `loom export`) goes through `verify_checkpoint` and
`SafeFileSystemReader`. A checkpoint holds only tensors in DCP files (read with
`weights_only=True` by DCP); everything else is JSON. DCP's `.metadata` is a pickle, so it
is read by an unpickler that admits an exact list of classes, then checked for shape: only
tensor entries, stored in this folder's own `__R_I.distcp` files.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType

from loom.config import ConfigError

MANIFEST = "manifest.json"
_DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")
_CHUNK = 1 << 22
_ALLOWED_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
        "TensorProperties", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}


class UnusableCheckpoint(ConfigError):
    """A checkpoint that is incomplete, corrupt or crafted; the same on every rank."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if is_dtype or name in _ALLOWED_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which is not a checkpoint "
                                     "metadata class")


def read_metadata(path: Path) -> Metadata:
    """Unpickle `.metadata` with exact classes only and check that it describes tensors in
    this folder's data files; anything else is an UnusableCheckpoint naming the file."""
    try:
        with open(path / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # any malformed pickle: one line, never a traceback
        raise UnusableCheckpoint(f"checkpoint {path} is unsafe: .metadata {e}") from None
    problem = _metadata_problem(metadata)
    if problem:
        raise UnusableCheckpoint(f"checkpoint {path} is unsafe: .metadata {problem}")
    return metadata


def _metadata_problem(metadata: Any) -> str | None:
    if type(metadata) is not Metadata:
        return f"holds a {type(metadata).__name__}, not DCP metadata"
    for key, entry in metadata.state_dict_metadata.items():
        if type(entry) is not TensorStorageMetadata:
            return f"entry {key} is not a tensor (loom checkpoints hold only tensors in DCP)"
    for info in (metadata.storage_data or {}).values():
        if type(info) is not _StorageInfo or not isinstance(info.relative_path, str) \
                or not _DATA_FILE.match(info.relative_path):
            name = getattr(info, "relative_path", info)
            return f"points at {name!r}, which is not a data file of this checkpoint"
        if info.transform_descriptors:
            return f"asks for storage transforms {list(info.transform_descriptors)}"
    return None


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with `read_metadata` above; refuses byte (pickled object) entries."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        if any(item.type == LoadItemType.BYTE_IO for item in plan.items):
            raise UnusableCheckpoint(f"checkpoint {self.path} asks to unpickle an object")
        return super().read_data(plan, planner)


def file_record(path: Path) -> dict[str, int]:
    digest, size = xxhash.xxh3_64(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "xxh3": digest.intdigest()}


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
    """Sizes and xxh3 hashes of every file in the folder (`known`: those the writing ranks already
    computed), written last: the save's seal."""
    files = {p.name: known.get(p.name) or file_record(p) for p in sorted(folder.iterdir())
             if p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({**fields, "files": files}, indent=1))


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest as plain JSON; UnusableCheckpoint if it is missing or malformed."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        if not all(isinstance(v.get("bytes"), int) and isinstance(v.get("xxh3"), int)
                   for v in files.values()):
            raise ValueError("bad file record")
    except FileNotFoundError:
        raise UnusableCheckpoint(f"checkpoint {path} has no {MANIFEST}: not a complete loom "
                                 "checkpoint") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UnusableCheckpoint(f"checkpoint {path} is corrupt: {MANIFEST} is unreadable "
                                 f"({e})") from None
    return manifest


def file_problems(path: Path, manifest: dict[str, Any], names: list[str]) -> list[str]:
    """Which of `names` are missing or differ from the manifest."""
    problems = []
    for name in names:
        expected, file = manifest["files"][name], path / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != expected["bytes"]:
            problems.append(f"{name} has {file.stat().st_size} bytes, expected "
                            f"{expected['bytes']}")
        elif file_record(file)["xxh3"] != expected["xxh3"]:
            problems.append(f"{name} checksum mismatch")
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
    for name in [".metadata", "loop.json"]:
        if name not in manifest["files"]:
            raise UnusableCheckpoint(f"checkpoint {path} is corrupt: {name} not in {MANIFEST}")
    metadata = read_metadata(path)
    unlisted = {i.relative_path for i in metadata.storage_data.values()} - set(names)
    if unlisted:
        raise UnusableCheckpoint(f"checkpoint {path} is unsafe: .metadata points at "
                                 f"{sorted(unlisted)[0]}, which is not in {MANIFEST}")
    return manifest


def read_json(path: Path, name: str) -> dict[str, Any]:
    try:
        value = json.loads((path / name).read_text())
    except (OSError, ValueError) as e:
        raise UnusableCheckpoint(f"checkpoint {path} is corrupt: {name} ({e})") from None
    if not isinstance(value, dict):
        raise UnusableCheckpoint(f"checkpoint {path} is corrupt: {name} is not an object")
    return value
