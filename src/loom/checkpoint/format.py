"""loom's on-disk layout for DCP checkpoints: raw tensor bytes and JSON metadata, no pickle.

torch's `FileSystemWriter` stores each tensor with `torch.save` and the checkpoint's
`Metadata` as a pickle (`.metadata`); reading either means unpickling. `TensorWriter` writes
each tensor chunk as its raw bytes into the rank's `__R_0.distcp` file and, at `finish`,
the `Metadata` as `metadata.json` (per tensor: dtype, size, and each chunk's offsets,
sizes, file, byte offset and length). `TensorReader` rebuilds `Metadata` from that JSON and
reads chunks back with `torch.frombuffer`. No `.metadata` is written, and one present is
never opened. Only tensors fit this format: any other state entry is refused on save and
cannot be described on load.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from loom.safe_io import read_json_capped

METADATA = "metadata.json"
FORMAT = "loom-dcp-1"
DATA_FILE = re.compile(r"^__\d+_0\.distcp$")
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}


@dataclass(frozen=True)
class StoredChunk:
    """Where one tensor chunk's raw bytes lie: `length` bytes at `offset` in `file`."""

    file: str
    offset: int
    length: int


def metadata_to_json(metadata: Metadata) -> dict[str, Any]:
    """The tensors `metadata` describes, each with its chunks and their storage."""
    tensors = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise ValueError(f"state entry {fqn} is not a tensor; loom keeps objects in JSON")
        chunks = []
        for chunk in entry.chunks:
            stored = metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]
            chunks.append({"offsets": list(chunk.offsets), "sizes": list(chunk.sizes),
                           "file": stored.file, "offset": stored.offset,
                           "length": stored.length})
        dtype = str(entry.properties.dtype).removeprefix("torch.")
        tensors[fqn] = {"dtype": dtype, "size": list(entry.size), "chunks": chunks}
    return {"format": FORMAT, "tensors": tensors}


MAX_DIMS = 8
MAX_EXTENT = 1 << 48
"""No tensor dimension, offset or byte count of a real checkpoint comes near 2**48."""
MAX_GRID_CELLS = 1 << 20
"""Bound on the pieces the coverage check cuts a tensor's chunk boundaries into."""


def _ints(value: Any, what: str, length: int | None = None) -> list[int]:
    if not isinstance(value, list) or len(value) > MAX_DIMS or \
            not all(type(v) is int and 0 <= v <= MAX_EXTENT for v in value):
        raise ValueError(f"{what} is not a list of at most {MAX_DIMS} integers in "
                         f"[0, 2**48]")
    if length is not None and len(value) != length:
        raise ValueError(f"{what} has {len(value)} dimensions, expected {length}")
    return value


def _nonnegative(value: Any, what: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_EXTENT:
        raise ValueError(f"{what} is not an integer in [0, 2**48]")
    return value


def check_coverage(fqn: str, size: list[int], chunks: list[ChunkStorageMetadata]) -> None:
    """The chunks cover the tensor exactly: every element in one chunk, none in two, none
    in no chunk (else a load leaves memory uninitialised, or one chunk overwrites another).
    Each chunk is a box; cutting the tensor at every chunk boundary gives a grid whose
    cells each lie wholly inside or outside each box, so counting per cell is exact."""
    if math.prod(size) == 0:
        return
    cuts = [sorted({0, n, *(c.offsets[d] for c in chunks),
                    *(c.offsets[d] + c.sizes[d] for c in chunks)}) for d, n in enumerate(size)]
    if math.prod(len(c) - 1 for c in cuts) > MAX_GRID_CELLS:
        raise ValueError(f"{fqn} is cut into too many chunks")
    count = torch.zeros([len(c) - 1 for c in cuts], dtype=torch.int32)
    for chunk in chunks:
        box = tuple(slice(bisect.bisect_left(cut, o), bisect.bisect_left(cut, o + s))
                    for cut, o, s in zip(cuts, chunk.offsets, chunk.sizes, strict=True))
        count[box] += 1
    if bool((count > 1).any()):
        raise ValueError(f"chunks of {fqn} overlap")
    if bool((count == 0).any()):
        raise ValueError(f"chunks of {fqn} leave part of it uncovered")


def check_byte_ranges(storage: dict[MetadataIndex, StoredChunk]) -> None:
    """No two chunks share bytes of a file: the tensors declared can then hold no more
    than the data files' bytes, whatever sizes the metadata states."""
    by_file: dict[str, list[StoredChunk]] = {}
    for stored in storage.values():
        if stored.length:
            by_file.setdefault(stored.file, []).append(stored)
    for name, ranges in by_file.items():
        ranges.sort(key=lambda r: r.offset)
        for before, after in itertools.pairwise(ranges):
            if before.offset + before.length > after.offset:
                raise ValueError(f"two chunks share bytes of {name}")


def _chunk(fqn: str, entry: dict[str, Any], chunk: Any, dtype: torch.dtype,
           ) -> tuple[ChunkStorageMetadata, StoredChunk]:
    where = f"a chunk of {fqn}"
    if not isinstance(chunk, dict) or set(chunk) != {"offsets", "sizes", "file", "offset",
                                                     "length"}:
        raise ValueError(f"{where} is not a chunk record")
    offsets = _ints(chunk["offsets"], f"{where}: offsets", len(entry["size"]))
    sizes = _ints(chunk["sizes"], f"{where}: sizes", len(entry["size"]))
    if any(o + s > n for o, s, n in zip(offsets, sizes, entry["size"], strict=True)):
        raise ValueError(f"{where} lies outside the tensor")
    if not isinstance(chunk["file"], str) or not DATA_FILE.match(chunk["file"]):
        raise ValueError(f"{where} points at {chunk['file']!r}, which is not a data file of "
                         "this checkpoint")
    length = _nonnegative(chunk["length"], f"{where}: length")
    numel = math.prod(sizes)
    if length != numel * dtype.itemsize:
        raise ValueError(f"{where} has {length} bytes, its sizes need "
                         f"{numel * dtype.itemsize}")
    stored = StoredChunk(chunk["file"], _nonnegative(chunk["offset"], f"{where}: offset"),
                         length)
    return ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)), stored


def metadata_from_json(value: Any) -> Metadata:
    """DCP `Metadata` from `metadata_to_json`'s output; ValueError names the first problem."""
    if not isinstance(value, dict) or value.get("format") != FORMAT \
            or not isinstance(value.get("tensors"), dict):
        raise ValueError(f"is not {FORMAT} metadata")
    entries, storage = {}, {}
    for fqn, entry in value["tensors"].items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "size", "chunks"}:
            raise ValueError(f"entry {fqn} is not a tensor (loom checkpoints hold only "
                             "tensors in DCP)")
        if not isinstance(entry["dtype"], str) or entry["dtype"] not in DTYPES:
            raise ValueError(f"entry {fqn} has dtype {entry['dtype']!r}")
        dtype = DTYPES[entry["dtype"]]
        _ints(entry["size"], f"size of {fqn}")
        if not isinstance(entry["chunks"], list) or len(entry["chunks"]) > MAX_GRID_CELLS:
            raise ValueError(f"chunks of {fqn} is not a list of at most {MAX_GRID_CELLS}")
        chunks = []
        for record in entry["chunks"]:
            chunk, stored = _chunk(fqn, entry, record, dtype)
            chunks.append(chunk)
            index = MetadataIndex(fqn, chunk.offsets)
            if index in storage:
                raise ValueError(f"chunks of {fqn} overlap")
            storage[index] = stored
        check_coverage(fqn, entry["size"], chunks)
        entries[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype),
                                             torch.Size(entry["size"]), chunks)
    check_byte_ranges(storage)
    return Metadata(entries, storage_data=storage)


def load_metadata(folder: Path) -> Metadata:
    """`folder`'s metadata.json as DCP `Metadata` (OSError, ValueError: unusable)."""
    return metadata_from_json(read_json_capped(folder / METADATA))


class TensorWriter(FileSystemWriter):
    """DCP's file writer, storing raw tensor bytes and `metadata.json` (see module doc)."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = f"{plan.storage_data.prefix}0.distcp"
        results = []
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    raise ValueError(f"state entry {item.index.fqn} is not a tensor; loom "
                                     "keeps objects in JSON")
                data = planner.resolve_data(item).detach().cpu().contiguous()
                raw = data.reshape(-1).view(torch.uint8).numpy()
                offset = stream.tell()
                stream.write(raw)
                results.append(WriteResult(item.index, raw.nbytes,
                                           StoredChunk(name, offset, raw.nbytes)))
            if self.sync_files:
                stream.flush()
                os.fsync(stream.fileno())
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for found in results for r in found}
        text = json.dumps(metadata_to_json(metadata), separators=(",", ":"))
        with self.fs.create_stream(self.fs.concat_path(self.path, METADATA), "wb") as f:
            f.write(text.encode())


class TensorReader(FileSystemReader):
    """DCP's file reader for `TensorWriter`'s checkpoints."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self._chunks: dict[MetadataIndex, tuple[torch.dtype, torch.Size]] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = load_metadata(Path(self.path))
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._chunks = {MetadataIndex(fqn, c.offsets): (entry.properties.dtype, c.sizes)
                        for fqn, entry in metadata.state_dict_metadata.items()
                        for c in entry.chunks}

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[Any]] = {}
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                raise ValueError(f"{item.storage_index.fqn} is not a tensor")
            by_file.setdefault(self.storage_data[item.storage_index].file, []).append(item)
        for name, items in by_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as f:
                for item in items:
                    source = self._read_chunk(f, item.storage_index)
                    for dim, (start, length) in enumerate(zip(item.storage_offsets,
                                                              item.lengths, strict=True)):
                        source = source.narrow(dim, start, length)
                    target = planner.resolve_tensor(item).detach()
                    target.copy_(source)
                    planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_chunk(self, f: Any, index: MetadataIndex) -> torch.Tensor:
        stored, (dtype, sizes) = self.storage_data[index], self._chunks[index]
        raw = torch.empty(stored.length, dtype=torch.uint8)
        f.seek(stored.offset)
        if f.readinto(raw.numpy()) != stored.length:
            raise ValueError(f"{stored.file} ends before the bytes of {index.fqn}")
        return raw.view(dtype).reshape(sizes)
