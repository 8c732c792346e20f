"""Documents of local files, cut into independent pieces of work for `loom tokenize`, and
read back in bounded memory.

A piece is a group of whole .txt files (each file one document), a byte range of one large
.txt file cut where the tokenizer would split anyway (blocks.py), a line-aligned byte range
of a .jsonl file, or one row group of a .parquet file, so pieces can be tokenized by
separate processes and a resumed run redoes only the unfinished ones. A compressed file
(.gz, .zst) cannot be entered in the middle and is one piece, decompressed as a stream.
Read with the standard library (pyarrow for parquet, zstandard for .zst): no `datasets`
import, no copy of the corpus, and never a whole file in memory.
"""

from __future__ import annotations

import codecs
import gzip
import io
import itertools
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from loom.config import ConfigError
from loom.data.blocks import CONTEXT, FRAGMENT_CHARS, Encode, NoSafeCut, fragments, safe_cuts
from loom.data.hub import LOCAL_FILES_HINT, ensure_hub_reachable

PIECE_BYTES = 16 * 2**20
"""Target input per piece: small enough to balance processes, big enough to batch well."""
READ_BYTES = 2**20
"""Bytes read from a file at a time (a text piece reads `block_chars` at a time)."""
PARQUET_ROWS = 1024
"""Rows read from a parquet row group at a time."""
COMPRESSED = (".gz", ".zst")


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
