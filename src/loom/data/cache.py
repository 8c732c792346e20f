"""The token cache: one folder per (source, split, column, limit, tokenizer) holding the flat
token stream as .npy, so a second run memory-maps it instead of tokenizing again.

Entries are written to a temporary folder and renamed into place, so a reader never sees a
half-written entry and two nodes racing on a shared file system cannot corrupt one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

CACHE_FORMAT = 1
"""Bumped whenever the layout of an entry changes, so old entries are not misread."""


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "loom"


def files_fingerprint(files: Iterable[Path]) -> str:
    """Identity of local files without reading them: path, size and modification time."""
    stats = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:16]


def cache_key(parts: dict[str, Any]) -> str:
    text = json.dumps({**parts, "format": CACHE_FORMAT}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class TokenCache:
    """One cache entry: `tokens.npy` (flat stream, end-of-text after every document) and
    `meta.json` (what produced it, the tokenizer's size and special ids)."""

    def __init__(self, root: Path, key: str):
        self.path = root / "tokens" / key

    @property
    def tokens_path(self) -> Path:
        return self.path / "tokens.npy"

    def exists(self) -> bool:
        return (self.path / "meta.json").is_file()

    def stream(self) -> CachedStream:
        return CachedStream(self.tokens_path)

    def meta(self) -> dict[str, Any]:
        return json.loads((self.path / "meta.json").read_text())

    def write(self, tokens: np.ndarray, meta: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}-", dir=self.path.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        np.save(tmp / "tokens.npy", tokens)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        try:
            os.rename(tmp, self.path)
        except OSError:  # another process finished the same entry first
            shutil.rmtree(tmp, ignore_errors=True)
            if not self.exists():
                raise


class CachedStream:
    """A cache entry's token array, memory-mapped on first use in each process (the map is
    not pickled, so loader workers open their own)."""

    def __init__(self, path: Path):
        self.path, self._tokens = path, None

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = np.load(self.path, mmap_mode="r")
        return self._tokens

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, window: slice) -> np.ndarray:
        return self.tokens[window]
