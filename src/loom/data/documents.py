"""The documents of a piece of local files (pieces.py) read back in bounded memory: for
`loom tokenize` as fragments cut where the tokenizer splits anyway (`PieceReader`), for
`--streaming` as whole documents (`read_piece`), and a hub dataset streamed.

Pieces are tokenized by separate processes and a resumed run redoes only the unfinished
ones; a compressed file (.gz, .zst) is one piece, decompressed as a stream (compressed.py).
Read with the standard library (pyarrow for parquet, zstandard for .zst): no `datasets`
import, no copy of the corpus, and never a whole file in memory.
"""

from __future__ import annotations

import codecs
import gzip
import json
import zlib
from collections.abc import Iterator
from typing import Any

from loom.config import ConfigError
from loom.data.blocks import FRAGMENT_CHARS, Encode, NoSafeCut, fragments
from loom.data.compressed import READ_BYTES, open_binary
from loom.data.hub import LOCAL_FILES_HINT, ensure_hub_reachable
from loom.data.pieces import Piece

PARQUET_ROWS = 1024
"""Rows read from a parquet row group at a time."""


class PieceReader:
    """A piece's text as (fragment, ends a document) pairs, in order, in bounded memory:
    a long document comes in fragments cut where `encode` splits anyway (blocks.py), so
    encoding the fragments one by one gives the document's tokens; at most about
    `block_chars` characters of a document are held at once.
    `consumed` counts the input bytes read so far (compressed bytes for .gz/.zst)."""

    def __init__(self, piece: Piece, column: str, block_chars: int, encode: Encode):
        self.piece, self.column, self.block_chars, self.encode = piece, column, block_chars, encode
        self.consumed = 0

    def __iter__(self) -> Iterator[tuple[str, bool]]:
        try:
            yield from self._read()
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise ConfigError(f"{self.piece.describe()}: corrupt or truncated compressed "
                              f"data ({e})") from None
        except Exception as e:
            if type(e).__name__ != "ZstdError":
                raise
            raise ConfigError(f"{self.piece.describe()}: corrupt or truncated zstd data "
                              f"({e})") from None

    def _read(self) -> Iterator[tuple[str, bool]]:
        kind = self.piece.kind
        if kind == "text":
            for path in self.piece.paths:
                yield from self._text_file(path)
        elif kind == "jsonl":
            for text in jsonl_documents(self.piece, self.column, self):
                yield from self._document(text)
        elif kind == "parquet":
            for text in parquet_documents(self.piece, self.column, self):
                yield from self._document(text)
        else:
            raise ValueError(f"cannot read a {kind} piece in blocks")

    def _document(self, text: str) -> Iterator[tuple[str, bool]]:
        if len(text) <= 4 * FRAGMENT_CHARS:
            yield text, True
            return
        step = self.block_chars
        chunks = (text[i:i + step] for i in range(0, len(text), step))
        yield from ((block, False) for block in self._blocks(chunks, self.piece.paths[0]))
        yield "", True

    def _blocks(self, chunks: Any, path: str) -> Iterator[str]:
        try:
            yield from fragments(chunks, self.block_chars, self.encode)
        except NoSafeCut as e:
            raise ConfigError(f"{path}: {e}") from None

    def _text_file(self, path: str) -> Iterator[tuple[str, bool]]:
        start, end = self.piece.start, self.piece.end
        done = self.consumed
        stream, raw = open_binary(path)
        with raw, stream:
            if start:
                stream.seek(start)

            def chunks() -> Iterator[str]:
                decoder, pos, size = codecs.getincrementaldecoder("utf-8")(), start, \
                    self.block_chars
                while True:
                    data = stream.read(size if end < 0 else min(size, end - pos))
                    self.consumed = done + raw.tell() - start
                    try:
                        yield decoder.decode(data, final=not data)
                    except UnicodeDecodeError as e:
                        raise ConfigError(f"{path}: not UTF-8 text near byte {pos + e.start:,}"
                                          ) from None
                    if not data:
                        return
                    pos += len(data)

            yield from ((block, False) for block in self._blocks(chunks(), path))
        if end < 0:
            yield "", True


def encode_document(text: str, encode: Encode, block_chars: int) -> list[int]:
    """A whole document's tokens, encoded a fragment at a time as `PieceReader`'s are (cut
    only where the tokenizer splits anyway, so the same tokens as encoding it whole): a Rust
    tokenizer holds ~200 bytes per character of one input while encoding it."""
    if len(text) <= block_chars:
        return encode([text])[0]
    chunks = (text[i:i + block_chars] for i in range(0, len(text), block_chars))
    try:
        return [t for part in fragments(chunks, block_chars, encode) for t in encode([part])[0]]
    except NoSafeCut as e:
        raise ConfigError(f"--streaming: a document of {len(text):,} characters: {e}"
                          ) from None


class BadLine(ConfigError):
    """A jsonl line that is not a JSON object with a text field."""


def _line_number(path: str, start: int, line: int) -> int:
    """The file's line number of line `line` of a piece starting at byte `start` (counted
    only when reporting an error)."""
    with open(path, "rb") as f:
        left, before = start, 0
        while left and (data := f.read(min(left, READ_BYTES))):
            before += data.count(b"\n")
            left -= len(data)
    return before + line


def _jsonl_text(line: bytes, column: str) -> str | None:
    """The line's text (None for a blank line or a null text); BadLine says what is wrong."""
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except ValueError:
        raise BadLine("is not JSON") from None
    if not isinstance(row, dict):
        raise BadLine(f"is a JSON {type(row).__name__}, not an object")
    if column not in row:
        raise BadLine(f"has no {column!r} field (fields: {', '.join(list(row)[:10])}; "
                      "--text-column picks another)")
    text = row[column]
    if text is not None and not isinstance(text, str):
        raise BadLine(f"field {column!r} holds a JSON {type(text).__name__}, not a string")
    return text


def jsonl_documents(piece: Piece, column: str, progress: PieceReader | None = None,
                    ) -> Iterator[str]:
    """The non-empty texts of a jsonl piece, one line at a time; a bad line is a
    ConfigError naming the file and line."""
    path = piece.paths[0]
    stream, raw = open_binary(path)
    with raw, stream:
        if piece.start:
            stream.seek(piece.start)
        pos = piece.start
        for number, line in enumerate(stream, 1):
            if 0 <= piece.end <= pos:
                break
            pos += len(line)
            if progress is not None:
                progress.consumed = raw.tell() - piece.start
            try:
                text = _jsonl_text(line, column)
            except BadLine as e:
                at = _line_number(path, piece.start, number)
                raise ConfigError(f"{path}: line {at:,} {e}") from None
            if text:
                yield text


def parquet_documents(piece: Piece, column: str, progress: PieceReader | None = None,
                      ) -> Iterator[str]:
    """The non-empty texts of one row group, PARQUET_ROWS rows at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = piece.paths[0]
    file = pq.ParquetFile(path)
    schema = file.schema_arrow
    if column not in schema.names:
        raise ConfigError(f"{path}: no column {column!r} (columns: {', '.join(schema.names)}; "
                          "--text-column picks another)")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ConfigError(f"{path}: column {column!r} holds {kind}, not strings")
    rows, done = max(file.metadata.row_group(piece.start).num_rows, 1), 0
    for batch in file.iter_batches(PARQUET_ROWS, row_groups=[piece.start], columns=[column]):
        done += batch.num_rows
        if progress is not None:
            progress.consumed = piece.size * done // rows
        yield from (text for text in batch.column(0).to_pylist() if text)


def read_piece(piece: Piece, column: str, split: str = "train") -> Iterator[str]:
    """The piece's documents, whole and in order (a hub piece: every row, empty ones
    included); `--streaming` reads these."""
    if piece.kind == "hub":
        yield from hub_documents(piece.paths[0], split, column)
    elif piece.kind == "text":
        for path in piece.paths:
            stream, raw = open_binary(path)
            with raw, stream:
                yield stream.read().decode()
    elif piece.kind == "parquet":
        yield from parquet_documents(piece, column)
    else:
        yield from jsonl_documents(piece, column)


def hub_documents(name: str, split: str, column: str, skip: int = 0) -> Iterator[str]:
    """A hub dataset streamed (nothing downloaded whole), from row `skip` on."""
    import datasets  # optional at run time: only a hub dataset needs it

    ensure_hub_reachable(name, "dataset", "--dataset", LOCAL_FILES_HINT)
    stream = datasets.load_dataset(name, split=split, streaming=True).skip(skip)
    return (row.get(column) or "" for row in stream)
