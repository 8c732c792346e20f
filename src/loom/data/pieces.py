"""The cutting of local files into independent pieces of work for `loom tokenize` and
`--streaming`: what a piece is (`Piece`) and where each file's pieces begin and end.

Kept apart from the reading of pieces (documents.py) because planning only looks at sizes,
line breaks, row groups and the tokenizer's safe cuts; it never reads a document whole.
A piece is a group of whole .txt files (each file one document), a byte range of one large
.txt file cut where the tokenizer would split anyway (blocks.py), a line-aligned byte range
of a .jsonl file, or one row group of a .parquet file. A compressed file (.gz, .zst) cannot
be entered in the middle and is one piece.
"""

from __future__ import annotations

import codecs
import itertools
from dataclasses import dataclass
from pathlib import Path

from loom.config import ConfigError
from loom.data.blocks import CONTEXT, Encode, safe_cuts
from loom.data.compressed import COMPRESSED

PIECE_BYTES = 16 * 2**20
"""Target input per piece: small enough to balance processes, big enough to batch well."""


@dataclass(frozen=True)
class Piece:
    kind: str
    """'text', 'jsonl', 'parquet' or 'hub' (a streamed hub dataset, one piece)."""
    paths: tuple[str, ...]
    start: int = 0
    """text, jsonl: first byte; parquet: row group."""
    end: int = -1
    """text, jsonl: byte after the range (-1 = end of file; a text document ends there)."""
    size: int = 0
    """Bytes of input, for the progress figure."""

    def describe(self) -> str:
        """Where the piece is, for error messages."""
        where = self.paths[0] + (f" and {len(self.paths) - 1} more files"
                                 if len(self.paths) > 1 else "")
        if self.kind == "parquet":
            return f"{where} (row group {self.start})"
        if self.start or self.end >= 0:
            return f"{where} (bytes {self.start:,}-{f'{self.end:,}' if self.end >= 0 else 'end'})"
        return where


def kind_of(builder: str, path: Path) -> str:
    kinds = {"text": "text", "json": "jsonl", "parquet": "parquet"}
    if builder not in kinds:
        raise ConfigError(f"loom tokenize: {path} is {builder}; expected .txt, .jsonl or "
                          ".parquet files")
    return kinds[builder]


def plan_pieces(files: tuple[Path, ...], builder: str, encode: Encode | None = None,
                ) -> list[Piece]:
    """Every file's pieces, in file order; the order fixes the token order. With the
    tokenizer's `encode`, a large uncompressed .txt file is cut into several pieces."""
    kind = kind_of(builder, files[0])
    if kind == "text":
        return _text_pieces(files, encode)
    if kind == "parquet":
        return [p for f in files for p in _parquet_pieces(f)]
    return [p for f in files for p in _jsonl_pieces(f)]


def _text_pieces(files: tuple[Path, ...], encode: Encode | None) -> list[Piece]:
    pieces, group, size = [], [], 0
    for f in files:
        total = f.stat().st_size
        if encode is not None and total > PIECE_BYTES and not f.name.endswith(COMPRESSED):
            cuts = _text_cuts(f, total, encode)
            pieces += [Piece("text", (str(f),), a, b if b < total else -1, b - a)
                       for a, b in itertools.pairwise(cuts)]
            continue
        group.append(str(f))
        size += total
        if size >= PIECE_BYTES:
            pieces.append(Piece("text", tuple(group), size=size))
            group, size = [], 0
    if group:
        pieces.append(Piece("text", tuple(group), size=size))
    return pieces


def _text_cuts(path: Path, total: int, encode: Encode) -> list[int]:
    """Byte offsets about PIECE_BYTES apart where the tokenizer splits anyway: each is
    found in a window read at the target (the window skips a split UTF-8 character)."""
    window, cuts, step = 64 * CONTEXT, [0], _even_step(total)
    target = step
    with path.open("rb") as f:
        while target < total:
            f.seek(target)
            data = f.read(window)
            skip = next((i for i, b in enumerate(data[:4]) if b & 0xC0 != 0x80), 0)
            try:
                text = codecs.getincrementaldecoder("utf-8")().decode(data[skip:])
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}: not UTF-8 text near byte "
                                  f"{target + skip + e.start:,}") from None
            cut = next((c for c in safe_cuts(text, 4 * CONTEXT, encode) if c >= CONTEXT), None)
            if cut is None:  # nowhere safe in this window: look further on
                target += window
                continue
            cuts.append(target + skip + len(text[:cut].encode()))
            target = cuts[-1] + step
    return [*cuts, total]


def _even_step(total: int) -> int:
    """Piece size for a file of `total` bytes: at most PIECE_BYTES, all about equal, so
    the last piece does not leave the other processes idle (21 MB: 2 x 10.5, not 16 + 5)."""
    pieces = max(1, -(-total // PIECE_BYTES))
    return max(1, -(-total // pieces))


def _jsonl_pieces(path: Path) -> list[Piece]:
    """Byte ranges that start and end on line breaks (a compressed file stays whole)."""
    total = path.stat().st_size
    if path.name.endswith(COMPRESSED):
        return [Piece("jsonl", (str(path),), size=total)]
    cuts, step = [0], _even_step(total)
    with path.open("rb") as f:
        while cuts[-1] + step < total:
            f.seek(cuts[-1] + step)
            f.readline()
            cuts.append(min(f.tell(), total))
    cuts.append(total)
    return [Piece("jsonl", (str(path),), a, b, b - a)
            for a, b in itertools.pairwise(cuts) if b > a]


def _parquet_pieces(path: Path) -> list[Piece]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("loom tokenize: parquet files need pyarrow "
                          "(installed with `datasets`)") from None
    meta = pq.ParquetFile(path).metadata
    return [Piece("parquet", (str(path),), g, size=meta.row_group(g).total_byte_size)
            for g in range(meta.num_row_groups)]

