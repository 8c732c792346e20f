"""Tokenizer processes for `loom tokenize`: each takes pieces (pieces.py) one at a
time and writes each piece's tokens to `OUT/.parts/` block by block, so its memory does not
grow with the piece; the parent watches every process, so one that dies (killed, out of
memory, crashed) ends the run at once, naming the piece, instead of hanging.

Kept free of torch imports: a spawned worker imports only this module's dependencies.
"""

from __future__ import annotations

import collections
import contextlib
import json
import multiprocessing
import os
import resource
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np

from loom.config import ConfigError
from loom.data.cache import token_dtype
from loom.data.documents import PieceReader
from loom.data.pieces import Piece
from loom.data.tokenizers import TextTokenizer, load_tokenizer

ENCODE_BATCH = 256
"""Documents per tokenizer call (at most)."""
BLOCK_CHARS = 2**18
"""Characters per tokenizer call (give or take one document of up to twice that): what
bounds a worker's memory, whatever the file size (a Rust tokenizer holds ~200 bytes per
character of its input while encoding it)."""


class Parts:
    """`OUT/.parts/`: numbered token files plus a JSON note each; the note is written after
    the tokens and renamed into place, so a part with a note is complete."""

    def __init__(self, out: Path):
        self.root = out / ".parts"

    def note(self, index: int) -> Path:
        return self.root / f"{index:06d}.json"

    def done(self, index: int) -> bool:
        return self.note(index).is_file()

    def write(self, index: int, tokens: np.ndarray, documents: int, size: int) -> None:
        tokens.tofile(self.root / f"{index:06d}.bin")
        self.finish(index, {"tokens": int(tokens.size), "documents": documents, "bytes": size})

    def finish(self, index: int, info: dict[str, int]) -> None:
        """Mark part `index` complete (its tokens are in place)."""
        tmp = self.root / f".{index:06d}.json.tmp"
        tmp.write_text(json.dumps(info))
        tmp.rename(self.note(index))

    def read(self, index: int, dtype: np.dtype) -> np.ndarray:
        """The part's tokens, memory-mapped (a part can be larger than memory)."""
        if self.info(index)["tokens"] == 0:
            return np.empty(0, dtype)
        return np.memmap(self.root / f"{index:06d}.bin", dtype=dtype, mode="r")

    def info(self, index: int) -> dict[str, int]:
        return json.loads(self.note(index).read_text())

    def claim(self, plan: dict[str, Any]) -> None:
        """Start or resume; a folder left by a different source or tokenizer is refused."""
        self.root.mkdir(parents=True, exist_ok=True)
        plan = json.loads(json.dumps(plan))  # tuples as lists, as read back
        path = self.root / "plan.json"
        if path.is_file() and json.loads(path.read_text()) != plan:
            raise ConfigError(f"{self.root.parent} holds an interrupted tokenization of a "
                              "different source or tokenizer; delete it or pick another OUT")
        path.write_text(json.dumps(plan))


@dataclass(frozen=True)
class Job:
    """One piece for a worker; `block_chars` bounds the text it holds at once."""

    index: int
    piece: Piece
    column: str
    out: str
    block_chars: int


def batches(fragments: Iterable[tuple[str, bool]], block_chars: int,
            ) -> Iterator[list[tuple[str, bool]]]:
    """(text, ends a document) pairs grouped into tokenizer calls of about `block_chars`
    characters or ENCODE_BATCH documents."""
    batch, chars = [], 0
    for fragment, ends in fragments:
        batch.append((fragment, ends))
        chars += len(fragment)
        if chars >= block_chars or len(batch) >= ENCODE_BATCH:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def encode_batch(batch: list[tuple[str, bool]], tokenizer: TextTokenizer, dtype: np.dtype,
                 ) -> np.ndarray:
    """The batch's tokens, end-of-text after each fragment that ends a document."""
    flat: list[int] = []
    for ids, (_, ends) in zip(tokenizer.encode([text for text, _ in batch]), batch,
                              strict=True):
        flat += ids
        if ends:
            flat.append(tokenizer.eot_id)
    return np.array(flat, dtype=dtype)


def encode_piece(job: Job, tokenizer: TextTokenizer,
                 report: Callable[[int, int], None]) -> dict[str, int]:
    """Tokenize a piece batch by batch into a temporary file, renamed when whole, then its
    note; `report(bytes, tokens)` after each batch. Memory holds one batch of text and its
    tokens, whatever the piece's size."""
    parts, dtype = Parts(Path(job.out)), token_dtype(tokenizer.size)
    reader = PieceReader(job.piece, job.column, job.block_chars, tokenizer.encode)
    tmp = parts.root / f".{job.index:06d}.bin.tmp"
    tokens = documents = reported = 0
    with tmp.open("wb") as f:
        for batch in batches(reader, job.block_chars):
            flat = encode_batch(batch, tokenizer, dtype)
            flat.tofile(f)
            tokens += flat.size
            documents += sum(ends for _, ends in batch)
            report(reader.consumed - reported, flat.size)
            reported = reader.consumed
    tmp.rename(parts.root / f"{job.index:06d}.bin")
    info = {"tokens": tokens, "documents": documents, "bytes": job.piece.size}
    parts.finish(job.index, info)
    return {**info, "peak_rss_mb": peak_rss_mb()}


def peak_rss_mb() -> int:
    """This process's peak resident memory. /proc's VmHWM where there is one: a spawned
    process's ru_maxrss also counts the parent's pages, shared between fork and exec."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) // 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def _worker(conn: Connection, tokenizer_name: str | None, threads: int) -> None:
    """A tokenizer process: runs the jobs `conn` sends until None, reporting
    ("progress", bytes, tokens), then ("done", info), ("bad", message) or ("failed", why).
    With `threads` > 1 (fewer pieces than -j) the Rust tokenizer encodes a batch on that
    many threads; otherwise -j processes are the parallelism."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the workers
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    try:
        tokenizer = load_tokenizer(tokenizer_name)
        while (job := conn.recv()) is not None:
            try:
                info = encode_piece(job, tokenizer, lambda b, t: conn.send(("progress", b, t)))
                conn.send(("done", info))
            except ConfigError as e:
                conn.send(("bad", str(e)))
            except Exception as e:  # reported by the parent, naming the piece
                conn.send(("failed", f"{type(e).__name__}: {' '.join(str(e).split())}"))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the parent is gone


class WorkerDied(RuntimeError):
    """A tokenizer process ended without finishing its piece (killed, out of memory, crashed)."""


def exit_cause(code: int | None) -> str:
    """A worker's exit code in words (the OOM killer's signal is SIGKILL)."""
    if code is None or code >= 0:
        return f"exited with status {code}"
    name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
    hint = " (the kernel's out-of-memory killer sends it)" if -code == signal.SIGKILL else ""
    return f"killed by {name}{hint}"


@dataclass
class Worker:
    process: BaseProcess
    conn: Connection
    job: Job | None = None
    reported: int = 0


def _start_workers(count: int, jobs: int, tokenizer: str | None) -> list[Worker]:
    """`count` processes sharing `jobs` cores."""
    context = multiprocessing.get_context("spawn")  # Rust tokenizer threads do not fork safely
    workers = []
    for i in range(count):
        mine, theirs = context.Pipe()
        threads = jobs // count + (i < jobs % count)
        process = context.Process(target=_worker, args=(theirs, tokenizer, threads),
                                  daemon=True)
        process.start()
        theirs.close()
        workers.append(Worker(process, mine))
    return workers


def _stop_workers(workers: list[Worker]) -> None:
    """Ask idle workers to exit; terminate any still running (after an error)."""
    for w in workers:
        if w.process.is_alive():
            if w.job is None:
                with contextlib.suppress(OSError):
                    w.conn.send(None)
            else:
                w.process.terminate()
    for w in workers:
        w.process.join(timeout=10)
        if w.process.is_alive():
            w.process.kill()
            w.process.join()
        w.conn.close()


def _handle(w: Worker, message: tuple, progress: Callable[[int, int], None], peaks: list[int],
            ) -> None:
    """One message of worker `w`; a worker's error ends the run here."""
    assert w.job is not None
    kind, *rest = message
    if kind == "progress":
        w.reported += rest[0]
        progress(rest[0], rest[1])
    elif kind == "done":
        progress(w.job.piece.size - w.reported, 0)
        peaks.append(rest[0]["peak_rss_mb"])
        w.job, w.reported = None, 0
    elif kind == "bad":
        raise ConfigError(rest[0])
    else:
        raise RuntimeError(f"tokenizing {w.job.piece.describe()} failed: {rest[0]}")


def tokenize_local(pieces: list[Piece], parts: Parts, column: str, tokenizer: str | None,
                   jobs: int, progress: Callable[[int, int], None],
                   block_chars: int = BLOCK_CHARS) -> list[int]:
    """Tokenize the unfinished pieces in `jobs` processes; returns each worker piece's peak
    RSS (MB); `progress(bytes, tokens)` as they go. A worker that dies ends the run at once
    (WorkerDied), its part unfinished."""
    pending = collections.deque(Job(i, p, column, str(parts.root.parent), block_chars)
                                for i, p in enumerate(pieces) if not parts.done(i))
    if len(pending) < len(pieces):
        print(f"resuming: {len(pieces) - len(pending)} of {len(pieces)} pieces already "
              "tokenized", file=sys.stderr)
    if not pending:
        return []
    peaks: list[int] = []
    workers = _start_workers(min(jobs, len(pending)), jobs, tokenizer)
    try:
        while pending or any(w.job for w in workers):
            for w in workers:
                if w.job is None and pending:
                    w.job = pending.popleft()
                    with contextlib.suppress(OSError):  # a dead worker is reported below
                        w.conn.send(w.job)
            wait([w.conn for w in workers] + [w.process.sentinel for w in workers], timeout=5)
            for w in workers:
                with contextlib.suppress(EOFError, OSError):
                    while w.conn.poll():
                        _handle(w, w.conn.recv(), progress, peaks)
                if not w.process.is_alive():
                    where = f"tokenizing {w.job.piece.describe()}" if w.job else \
                        "between pieces"
                    raise WorkerDied(f"the worker {where} died: "
                                     f"{exit_cause(w.process.exitcode)}; its part is "
                                     "unfinished, rerun to resume")
    finally:
        _stop_workers(workers)
    return peaks


