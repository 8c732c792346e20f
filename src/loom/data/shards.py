"""Token shards written by `loom tokenize`: fixed-size flat token files and a JSON manifest.

Training memory-maps the shards, so start-up reads only the manifest, every rank opens the
files itself (no rank waits on another), and resident memory stays the pages in use,
whatever the corpus size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from loom.config import ConfigError

MANIFEST = "manifest.json"
SHARD_FORMAT = 1
"""Bumped whenever the layout of a shard folder changes."""


def is_shard_folder(path: str | Path) -> bool:
    return (Path(path).expanduser() / MANIFEST).is_file()


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest, checked against the files on disk (sizes only: nothing is read)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--dataset {folder}: unreadable {MANIFEST} ({e})") from None
    if manifest.get("format") != SHARD_FORMAT:
        raise ConfigError(f"--dataset {folder}: shard format {manifest.get('format')}, "
                          f"expected {SHARD_FORMAT}; run `loom tokenize` again")
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for shard in manifest["shards"]:
        path = folder / shard["file"]
        if not path.is_file() or path.stat().st_size != shard["tokens"] * itemsize:
            raise ConfigError(f"--dataset {folder}: {shard['file']} is missing or has the "
                              "wrong size; run `loom tokenize` again")
    return manifest


class ShardStream:
    """The shards as one read-only token sequence; a slice may span shards. Each shard is
    mapped on first use, and the maps are not pickled (loader workers map their own)."""

    def __init__(self, folder: Path, manifest: dict[str, Any]):
        self.folder, self.dtype = folder, np.dtype(manifest["dtype"])
        self.shard_tokens = int(manifest["shard_tokens"])
        self.files = [s["file"] for s in manifest["shards"]]
        self.n_tokens = int(manifest["n_tokens"])
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return self.n_tokens

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}}

    def shard(self, index: int) -> np.memmap:
        if index not in self._maps:
            self._maps[index] = np.memmap(self.folder / self.files[index], dtype=self.dtype,
                                          mode="r")
        return self._maps[index]

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop, _ = window.indices(self.n_tokens)
        pieces = []
        while start < stop:
            index, offset = divmod(start, self.shard_tokens)
            take = min(stop - start, self.shard_tokens - offset)
            pieces.append(self.shard(index)[offset:offset + take])
            start += take
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.empty(0, self.dtype)
