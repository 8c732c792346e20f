"""Compressed input files (.gz, .zst) read as a stream of their decompressed bytes.

Kept apart because both the pieces of `loom tokenize` (documents.py) and chat files
(chat.py) read through `open_binary`, and because a .zst file needs its own frame-by-frame
reader (`ZstdFrames`) so that a truncated file is an error, not short data. Standard
library gzip; zstandard only when a .zst file is opened.
"""

from __future__ import annotations

import gzip
import io
from typing import Any, BinaryIO

from loom.config import ConfigError

READ_BYTES = 2**20
"""Bytes read from a file at a time (a text piece reads `block_chars` at a time)."""
COMPRESSED = (".gz", ".zst")
"""Suffixes of files that `open_binary` decompresses (and that cannot be entered in the
middle)."""


def open_binary(path: str) -> tuple[BinaryIO, BinaryIO]:
    """(the file's bytes, decompressed as they are read; the file underneath, whose
    position measures progress)."""
    raw = open(path, "rb")  # noqa: SIM115 - closed by the caller, with the stream
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw), raw
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raw.close()
            raise ConfigError(f"{path}: .zst files need zstandard (pip install zstandard)"
                              ) from None
        return io.BufferedReader(ZstdFrames(raw, zstandard), READ_BYTES), raw
    return raw, raw


class ZstdFrames(io.RawIOBase):
    """A .zst file's frames decompressed one after another. A file that ends inside a frame
    is a ZstdError: zstandard's own stream reader returns the short data silently."""

    def __init__(self, raw: BinaryIO, zstandard: Any):
        self.raw, self.zstandard = raw, zstandard
        self.frame: Any = None
        self.out, self.pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self.pos == len(self.out):
            data = b""
            if self.frame is not None and self.frame.eof:  # the next frame starts here
                data, self.frame = self.frame.unused_data, None
            if not data and not (data := self.raw.read(READ_BYTES)):
                if self.frame is not None:
                    raise self.zstandard.ZstdError("the file ends inside a frame (truncated)")
                return 0
            if self.frame is None:
                self.frame = self.zstandard.ZstdDecompressor().decompressobj()
            self.out, self.pos = self.frame.decompress(data), 0
        n = min(len(buffer), len(self.out) - self.pos)
        buffer[:n] = self.out[self.pos:self.pos + n]
        self.pos += n
        return n
