"""Documents of local files, cut into independent pieces of work for `loom tokenize`.

A piece is a group of whole .txt files (each file one document), a line-aligned byte
range of a .jsonl file, or one row group of a .parquet file, so pieces can be tokenized
by separate processes and a resumed run redoes only the unfinished ones. Read with the
standard library (and pyarrow for parquet): no `datasets` import, no copy of the corpus.
"""

from __future__ import annotations

import gzip
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from loom.config import ConfigError

PIECE_BYTES = 16 * 2**20
"""Target text per piece: small enough to balance processes, big enough to batch well."""


@dataclass(frozen=True)
class Piece:
    kind: str
    """'text', 'jsonl', 'parquet' or 'hub' (a streamed hub dataset, one piece)."""
    paths: tuple[str, ...]
    start: int = 0
    """jsonl: first byte; parquet: row group."""
    end: int = -1
    """jsonl: byte after the range (-1 = end of file)."""
    size: int = 0
    """Bytes of input, for the progress figure."""


def kind_of(builder: str, path: Path) -> str:
    kinds = {"text": "text", "json": "jsonl", "parquet": "parquet"}
    if builder not in kinds:
        raise ConfigError(f"loom tokenize: {path} is {builder}; expected .txt, .jsonl or "
                          ".parquet files")
    return kinds[builder]


def plan_pieces(files: tuple[Path, ...], builder: str) -> list[Piece]:
    """Every file's pieces, in file order; the order fixes the token order."""
    kind = kind_of(builder, files[0])
    if kind == "text":
        return _text_pieces(files)
    if kind == "parquet":
        return [p for f in files for p in _parquet_pieces(f)]
    return [p for f in files for p in _jsonl_pieces(f)]


def _text_pieces(files: tuple[Path, ...]) -> list[Piece]:
    pieces, group, size = [], [], 0
    for f in files:
        group.append(str(f))
        size += f.stat().st_size
        if size >= PIECE_BYTES:
            pieces.append(Piece("text", tuple(group), size=size))
            group, size = [], 0
    if group:
        pieces.append(Piece("text", tuple(group), size=size))
    return pieces


def _jsonl_pieces(path: Path) -> list[Piece]:
    """Byte ranges that start and end on line breaks (a .gz file stays whole)."""
    total = path.stat().st_size
    if path.name.endswith(".gz"):
        return [Piece("jsonl", (str(path),), size=total)]
    cuts = [0]
    with path.open("rb") as f:
        while cuts[-1] + PIECE_BYTES < total:
            f.seek(cuts[-1] + PIECE_BYTES)
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


def _open_text(path: str) -> TextIO:
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(
        path, encoding="utf-8")


def read_piece(piece: Piece, column: str, split: str = "train") -> Iterator[str]:
    """The piece's documents, in order (a hub piece: every row, empty ones included)."""
    if piece.kind == "hub":
        yield from hub_documents(piece.paths[0], split, column)
    elif piece.kind == "text":
        for path in piece.paths:
            with _open_text(path) as f:
                yield f.read()
    elif piece.kind == "parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(piece.paths[0]).read_row_group(piece.start)
        if column not in table.column_names:
            raise ConfigError(f"--text-column {column} not in {piece.paths[0]}; columns: "
                              f"{', '.join(table.column_names)}")
        yield from (text for text in table.column(column).to_pylist() if text)
    else:
        yield from _jsonl_documents(piece, column)


def _jsonl_documents(piece: Piece, column: str) -> Iterator[str]:
    path = piece.paths[0]
    with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
        f.seek(piece.start)
        lines = f.read(-1 if piece.end < 0 else piece.end - piece.start).splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)[column]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{path}: line {number} of the piece at byte {piece.start} is "
                              f"not a JSON object with a {column!r} field") from None
        if text:
            yield text


def hub_documents(name: str, split: str, column: str, skip: int = 0) -> Iterator[str]:
    """A hub dataset streamed (nothing downloaded whole), from row `skip` on."""
    import datasets

    from loom.data.hub import LOCAL_FILES_HINT, ensure_hub_reachable

    ensure_hub_reachable(name, "dataset", "--dataset", LOCAL_FILES_HINT)
    stream = datasets.load_dataset(name, split=split, streaming=True).skip(skip)
    return (row.get(column) or "" for row in stream)
