"""The files of an export: safetensors shards (with an index above the shard size), written
into the staging folder `loom.runtime.outputs.staged` swaps in once the export succeeded.

Written by hand rather than through the safetensors package so that tensors are streamed
one at a time: the layout is planned from meta tensors first, then each tensor is read,
converted and written, and only one is in memory at once.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from loom.models.hf_folder import INDEX, SINGLE
from loom.safe_io import write_text_atomic

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16"}
MAX_SHARD_BYTES = 5 * 1024**3
"""Shard size above which the weights are split across files with an index, as the Hub
does."""

Tensors = Callable[[Callable[[str], torch.Tensor]], Iterator[tuple[str, torch.Tensor]]]
"""Given a reader of loom tensors by name, the exported (name, tensor) pairs in order."""


def shard_layout(entries: list[tuple[str, torch.Size, torch.dtype]],
                 limit: int) -> list[list[tuple[str, torch.Size, torch.dtype]]]:
    """Consecutive tensors grouped into shards of at most `limit` bytes (a larger tensor
    gets a shard of its own)."""
    shards: list[list[tuple[str, torch.Size, torch.dtype]]] = [[]]
    size = 0
    for name, shape, dt in entries:
        nbytes = math.prod(shape) * dt.itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, shape, dt))
        size += nbytes
    return shards


def safetensors_header(shard: list[tuple[str, torch.Size, torch.dtype]]) -> bytes:
    """The header of a safetensors file holding `shard` in order: an 8-byte length, then
    JSON padded with spaces to a multiple of 8 bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dt in shard:
        nbytes = math.prod(shape) * dt.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dt], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_weights(folder: Path, tensors: Tensors, read: Callable[[str], torch.Tensor],
                  shapes: dict[str, Any], dt: torch.dtype, limit: int,
                  single: str = SINGLE) -> int:
    """Stream the exported tensors into safetensors files (one in memory at a time); the
    layout is planned first from meta tensors of the same shapes. Returns the file count."""
    entries = [(name, tuple(t.shape), dt) for name, t in
               tensors(lambda n: torch.empty(shapes[n], device="meta"))]
    shards = shard_layout(entries, limit)
    files = ([single] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    stream = tensors(read)
    weight_map = {}
    for file, shard in zip(files, shards, strict=True):
        with open(folder / file, "wb") as f:
            f.write(safetensors_header(shard))
            for name, shape, _ in shard:
                got, tensor = next(stream)
                assert got == name and tuple(tensor.shape) == shape, (got, name)
                f.write(tensor.detach().to(dt).contiguous().view(torch.uint8).numpy().tobytes())
                weight_map[name] = file
    if len(files) > 1:
        total = sum(math.prod(s) * dt.itemsize for _, s, _ in entries)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_text_atomic(folder / INDEX, json.dumps(index, indent=2) + "\n")
    return len(files)
