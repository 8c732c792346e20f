"""Token shards written by `loom tokenize`: fixed-size flat token files and a JSON manifest.

Training memory-maps the shards, so start-up reads only the manifest, every rank opens the
files itself (no rank waits on another), and resident memory stays the pages in use,
whatever the corpus size.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from loom.config import ConfigError
from loom.safe_io import read_json_capped, regular_size

MANIFEST = "manifest.json"
SHARD_FORMAT = 1
"""Bumped whenever the layout of a shard folder changes."""
TOKEN_DTYPES = ("uint16", "uint32")
"""What `loom.data.cache.token_dtype` picks."""
SHARD_FILE = re.compile(r"^shard-\d{5,}\.bin$")


def is_shard_folder(path: str | Path) -> bool:
    return (Path(path).expanduser() / MANIFEST).is_file()


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


def _check_layout(manifest: Any) -> None:
    """What the stream uses, as `loom tokenize` writes it (ValueError names the field): a
    shard folder may come from anyone, and its names and counts index files and memory."""
    if not isinstance(manifest, dict):
        raise ValueError("not an object")
    if manifest.get("dtype") not in TOKEN_DTYPES:
        raise ValueError(f"dtype {manifest.get('dtype')!r} is not one of {TOKEN_DTYPES}")
    counts = [manifest.get("shard_tokens"), manifest.get("n_tokens")]
    if not all(type(n) is int and 0 <= n < 2**53 for n in counts) or counts[0] < 1:
        raise ValueError("shard_tokens or n_tokens is not a count")
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not all(
            isinstance(s, dict) and isinstance(s.get("file"), str)
            and SHARD_FILE.match(s["file"]) and type(s.get("tokens")) is int
            and 0 <= s["tokens"] <= counts[0] for s in shards):
        raise ValueError("shards is not a list of {file: shard-NNNNN.bin, tokens}")
    if sum(s["tokens"] for s in shards) != counts[1]:
        raise ValueError("n_tokens is not the shards' sum")


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest, checked against the files on disk (sizes only: nothing is read; the
    shards must be regular files, never links)."""
    try:
        manifest = read_json_capped(folder / MANIFEST)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--dataset {folder}: unreadable {MANIFEST} ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != SHARD_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise ConfigError(f"--dataset {folder}: shard format {found}, expected "
                          f"{SHARD_FORMAT}; run `loom tokenize` again")
    try:
        _check_layout(manifest)
    except ValueError as e:
        raise ConfigError(f"--dataset {folder}: {MANIFEST} is malformed ({e}); run "
                          "`loom tokenize` again") from None
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for shard in manifest["shards"]:
        try:
            size = regular_size(folder / shard["file"])
        except (OSError, ValueError):
            size = -1
        if size != shard["tokens"] * itemsize:
            raise ConfigError(f"--dataset {folder}: {shard['file']} is missing, not a regular "
                              "file or has the wrong size; run `loom tokenize` again")
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
