"""`loom tokenize SRC OUT`: a corpus to fixed-size token shards and a manifest.

Pieces of the source (pieces.py) are tokenized by `-j` processes into `OUT/.parts/`,
each part written whole or not at all, so an interrupted run redoes only missing parts.
The parts are then packed in source order into shards of `--shard-tokens` tokens; the
manifest is written last, so a folder with a manifest is always complete.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import shutil
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from loom.config import ConfigError
from loom.data.cache import token_dtype
from loom.data.documents import hub_documents
from loom.data.pieces import plan_pieces
from loom.data.shards import MANIFEST, SHARD_FORMAT, shard_name
from loom.data.text import resolve_source
from loom.data.tokenizers import TextTokenizer, load_tokenizer, tokenizer_identity
from loom.data.workers import BLOCK_CHARS, ENCODE_BATCH, Parts, WorkerDied, tokenize_local
from loom.runtime.outputs import absolute_target, output_folder
from loom.runtime.rundir import first_link
from loom.runtime.staging import one_writer

HUB_DOCS_PER_PART = 20_000
"""A streamed hub dataset is cut into parts of this many documents."""


def encode(documents: Iterable[str], tokenizer: TextTokenizer, dtype: np.dtype,
           ) -> tuple[np.ndarray, int]:
    """Every document's tokens followed by end-of-text; returns (tokens, documents)."""
    chunks, batch, count = [], [], 0
    for text in [*documents, None]:
        if text is not None:
            batch.append(text)
        if batch and (text is None or len(batch) == ENCODE_BATCH):
            for ids in tokenizer.encode(batch):
                chunks.append(np.asarray([*ids, tokenizer.eot_id], dtype=dtype))
            count += len(batch)
            batch = []
    return (np.concatenate(chunks) if chunks else np.empty(0, dtype)), count


class Throughput:
    """A progress bar with MB/s and tokens/s on stderr (redrawn on a terminal, else a line
    every 10% and at least every LINE_EVERY seconds: one huge file is one long piece)."""

    LINE_EVERY = 30.0

    def __init__(self, total_bytes: int, stream: TextIO | None = None):
        self.total, self.t0 = max(total_bytes, 1), time.perf_counter()
        self.stream = stream or sys.stderr
        self.bytes = self.tokens = 0
        self.last_tenth, self.last_line = -1, self.t0

    def line(self) -> str:
        """The bar when the total is known (local files), else only the counts (hub)."""
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        frac = min(self.bytes / self.total, 1.0)
        bar = "#" * round(30 * frac) + "-" * (30 - round(30 * frac))
        done = f"[{bar}] {100 * frac:5.1f}%  " if self.total > 1 else ""
        return (f"{done}{self.bytes / 2**20:,.1f} MB  {self.bytes / 2**20 / elapsed:,.1f} "
                f"MB/s  {self.tokens / elapsed:,.0f} tok/s")

    def update(self, size: int, tokens: int) -> None:
        self.bytes += size
        self.tokens += tokens
        tenth = int(10 * self.bytes / self.total)
        if self.stream.isatty():
            self.stream.write("\r" + self.line())
        elif tenth > self.last_tenth or time.perf_counter() - self.last_line > self.LINE_EVERY:
            self.stream.write(self.line() + "\n")
            self.last_line = time.perf_counter()
        self.last_tenth = tenth
        self.stream.flush()

    def close(self) -> dict[str, float]:
        elapsed = time.perf_counter() - self.t0
        if self.stream.isatty() or self.last_tenth < 10:
            self.stream.write(("\r" if self.stream.isatty() else "") + self.line() + "\n")
        return {"seconds": elapsed, "mb_per_s": self.bytes / 2**20 / max(elapsed, 1e-9),
                "tokens_per_s": self.tokens / max(elapsed, 1e-9)}


def tokenize_hub(name: str, parts: Parts, split: str, column: str, tokenizer: TextTokenizer,
                 progress: Throughput) -> int:
    """Parts of HUB_DOCS_PER_PART rows, in this process; returns the part count."""
    done = 0
    while parts.done(done):
        done += 1
    rows = hub_documents(name, split, column, skip=done * HUB_DOCS_PER_PART)
    dtype = token_dtype(tokenizer.size)
    while batch := list(itertools.islice(rows, HUB_DOCS_PER_PART)):
        texts = [text for text in batch if text]
        tokens, count = encode(texts, tokenizer, dtype)
        size = sum(len(t.encode()) for t in texts)
        parts.write(done, tokens, count, size)
        progress.update(size, int(tokens.size))
        done += 1
    return done


def write_shards(parts: Parts, n_parts: int, out: Path, shard_tokens: int,
                 dtype: np.dtype) -> list[dict[str, Any]]:
    """Pack the parts, in order, into shards of `shard_tokens` (the last may be shorter)."""
    shards: list[dict[str, Any]] = []
    buffer, filled = np.empty(shard_tokens, dtype), 0

    def flush() -> None:
        nonlocal filled
        name = shard_name(len(shards))
        data = buffer[:filled]
        tmp = out / f".{name}.tmp"
        data.tofile(tmp)
        tmp.rename(out / name)
        shards.append({"file": name, "tokens": int(filled),
                       "sha256": hashlib.sha256(memoryview(data)).hexdigest()})
        filled = 0

    for index in range(n_parts):
        tokens = parts.read(index, dtype)
        while tokens.size:
            take = min(tokens.size, shard_tokens - filled)
            buffer[filled:filled + take] = tokens[:take]
            filled, tokens = filled + take, tokens[take:]
            if filled == shard_tokens:
                flush()
    if filled:
        flush()
    return shards


def check_out(out: Path) -> None:
    """OUT is a new or empty folder, or one an interrupted tokenization left (its `.parts`
    resumes): never a link, a file, a folder with a link in it, or one holding other
    files (the shards would be written among them)."""
    output_folder(out, "loom tokenize OUT", nonempty_ok=True)
    if not out.is_dir():
        return
    link = first_link(out)
    if link is not None:
        raise ConfigError(f"loom tokenize OUT {out}: {link.relative_to(out)} is a symbolic "
                          "link; loom never writes through links: choose another folder")
    names = sorted(p.name for p in out.iterdir())
    if names and ".parts" not in names and MANIFEST not in names:
        raise ConfigError(f"loom tokenize OUT {out} is not empty (it holds {names[0]}); "
                          "choose a new or empty folder")


def tokenize(src: str, out: Path, **options: Any) -> dict[str, Any]:
    """Tokenize `src` into `out` (resuming an interrupted run), one tokenization into it at
    a time (the lock beside it); returns the manifest. `options`: `write_corpus`'s."""
    check_out(out)
    with one_writer(absolute_target(out), "loom tokenize OUT"):
        return write_corpus(src, out, **options)


def write_corpus(src: str, out: Path, *, tokenizer_name: str | None = None, jobs: int = 1,
                 shard_tokens: int = 100_000_000, split: str = "train", column: str = "text",
                 block_chars: int = BLOCK_CHARS) -> dict[str, Any]:
    """`tokenize` in a checked, locked `out`."""
    if (out / MANIFEST).is_file():
        raise ConfigError(f"{out} already holds tokenized shards ({MANIFEST}); delete it "
                          "or pick another OUT")
    source = resolve_source(src)
    tokenizer = load_tokenizer(tokenizer_name)
    dtype = token_dtype(tokenizer.size)
    parts = Parts(out)
    pieces = [] if source.kind == "hub" else plan_pieces(source.files, source.builder,
                                                          tokenizer.encode)
    parts.claim({"source": source.identity(), "split": split, "column": column,
                 "tokenizer": tokenizer_identity(tokenizer_name),
                 "pieces": [asdict(p) for p in pieces]})
    progress = Throughput(sum(p.size for p in pieces) or 1)
    if source.kind == "hub":
        n_parts = tokenize_hub(source.name, parts, split, column, tokenizer, progress)
    else:
        progress.total = max(1, sum(p.size for i, p in enumerate(pieces)
                                    if not parts.done(i)))  # this run's work only
        peaks = tokenize_local(pieces, parts, column, tokenizer_name, jobs, progress.update,
                               block_chars)
        n_parts = len(pieces)
    speed = {**progress.close(), "worker_peak_rss_mb": max(peaks, default=0)}
    infos = [parts.info(i) for i in range(n_parts)]
    n_tokens = sum(i["tokens"] for i in infos)
    if n_tokens == 0:
        raise ConfigError(f"loom tokenize: {src} holds no text (column {column!r})")
    manifest = {"format": SHARD_FORMAT, "source": source.name, "split": split,
                "column": column, "tokenizer": tokenizer.name,
                "tokenizer_identity": tokenizer_identity(tokenizer_name),
                "vocab_size": tokenizer.size, "eot_id": tokenizer.eot_id,
                "pad_id": tokenizer.pad_id, "dtype": dtype.name, "shard_tokens": shard_tokens,
                "n_tokens": n_tokens, "documents": sum(i["documents"] for i in infos),
                "bytes": sum(i["bytes"] for i in infos),
                "shards": write_shards(parts, n_parts, out, shard_tokens, dtype)}
    (out / f".{MANIFEST}.tmp").write_text(json.dumps(manifest, indent=2) + "\n")
    (out / f".{MANIFEST}.tmp").rename(out / MANIFEST)
    shutil.rmtree(parts.root)
    print(f"{src}: {manifest['documents']:,} documents, {n_tokens:,} tokens in "
          f"{len(manifest['shards'])} shards -> {out} ({speed['seconds']:.1f} s, "
          f"{speed['mb_per_s']:.1f} MB/s, {speed['tokens_per_s']:,.0f} tok/s, worker peak RSS "
          f"{speed['worker_peak_rss_mb']:,} MB)")
    return {**manifest, "speed": speed}


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="loom tokenize",
                                     description="tokenize a corpus into memory-mappable shards")
    parser.add_argument("src", help="a .txt/.jsonl/.parquet file, a folder of them, or a hub "
                        "dataset id (streamed)")
    parser.add_argument("out", type=Path, help="folder for the shards and manifest.json")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1,
                        help="tokenizer processes (local files)")
    parser.add_argument("--tokenizer-name", "--tokenizer_name", default=None,
                        help="hub id or local folder (default: the shipped GPT-2)")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000,
                        help="tokens per shard")
    parser.add_argument("--split", default="train", help="hub dataset split")
    parser.add_argument("--text-column", default="text", help="jsonl/parquet/hub text field")
    opts = parser.parse_args(list(argv))
    try:
        if opts.jobs < 1 or opts.shard_tokens < 1:
            raise ConfigError("-j and --shard-tokens must be >= 1")
        tokenize(opts.src, opts.out, tokenizer_name=opts.tokenizer_name, jobs=opts.jobs,
                 shard_tokens=opts.shard_tokens, split=opts.split, column=opts.text_column)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except WorkerDied as e:
        print(f"error: loom tokenize: {e}", file=sys.stderr)
        return 1
    except (OSError, RuntimeError, ValueError) as e:
        print(f"error: loom tokenize failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0
