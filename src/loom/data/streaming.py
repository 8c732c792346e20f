"""`--streaming`: documents read, tokenized and packed on the fly, for corpora too large to
pre-tokenize.

Document d of piece p (pieces.py; a hub dataset is one piece) belongs to dp rank
(p + d) mod dp, so the tp ranks of a dp group read the same tokens. Each rank packs its
documents, end-of-text after each, into windows of seq_len + 1 tokens. After every window
the position of the next unread token, (epoch, piece, document, offset), is known; a
checkpoint stores every dp rank's position, and a resumed run starts exactly there.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from loom.config import ConfigError, JobConfig
from loom.data.documents import encode_document, read_piece
from loom.data.pieces import Piece, plan_pieces
from loom.data.text import resolve_source
from loom.data.tokenizers import TextTokenizer, load_tokenizer
from loom.data.workers import BLOCK_CHARS


class Position(NamedTuple):
    """Where the next unread token is (a tuple: a later position compares greater)."""

    epoch: int = 0
    piece: int = 0
    """Index into the stream's pieces (pieces.py)."""
    document: int = 0
    offset: int = 0
    """Tokens of that document (end-of-text included) already consumed."""


@dataclass(frozen=True)
class StreamSpec:
    """What every rank's stream reads: built once by `build_datasets`."""

    pieces: tuple[Piece, ...]
    column: str
    split: str
    tokenizer: TextTokenizer
    seq_len: int
    batches: int
    """Nominal loader length: --max-steps x --grad-accum-steps."""


class PackedStream:
    """This dp rank's windows, in order, from `position` on (the loop's only data source
    under --streaming: nothing is prefetched, so `position` is exact between steps)."""

    def __init__(self, spec: StreamSpec, dp_rank: int, dp_size: int):
        self.pieces, self.column, self.split = spec.pieces, spec.column, spec.split
        self.tokenizer, self.width = spec.tokenizer, spec.seq_len + 1
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.position = Position()

    def documents(self, start: Position) -> Iterator[tuple[Position, list[int]]]:
        """(position of the document's first token, its tokens + end-of-text), forever."""
        for epoch in itertools.count(start.epoch):
            found = False
            for p in range(len(self.pieces)):
                texts = read_piece(self.pieces[p], self.column, self.split)
                for d, text in enumerate(texts):
                    if not text or (p + d) % self.dp_size != self.dp_rank:
                        continue
                    found = True
                    if (epoch, p, d) >= (start.epoch, start.piece, start.document):
                        ids = encode_document(text, self.tokenizer.encode, BLOCK_CHARS)
                        yield Position(epoch, p, d), [*ids, self.tokenizer.eot_id]
            if not found:
                raise ConfigError(f"--streaming: no documents for dp rank {self.dp_rank} of "
                                  f"{self.dp_size}; use fewer data-parallel ranks or more data")

    def windows(self) -> Iterator[list[int]]:
        """Windows of seq_len + 1 tokens; `position` advances past each as it is yielded."""
        start, window = self.position, []
        for doc, tokens in self.documents(start):
            offset = start.offset if doc == Position(start.epoch, start.piece,
                                                     start.document) else 0
            while offset < len(tokens):
                take = tokens[offset:offset + self.width - len(window)]
                window += take
                offset += len(take)
                if len(window) == self.width:
                    self.position = Position(doc.epoch, doc.piece, doc.document, offset) \
                        if offset < len(tokens) else Position(doc.epoch, doc.piece,
                                                              doc.document + 1)
                    yield window
                    window = []


class StreamLoader:
    """Batches of a PackedStream with the loader interface the training loop uses.
    `len` is nominal (--max-steps worth): a stream has no epoch length. `dataset` is the
    stream, as a DataLoader's is its dataset: the trainer asks it whether it is a mixture
    (a stream never is) when it checkpoints, resumes and summarises."""

    def __init__(self, stream: PackedStream, batch_size: int, batches: int):
        self.stream, self.batch_size, self.batches = stream, batch_size, batches
        self.dataset = stream
        self.sampler = self  # set_epoch() is called on the sampler

    def __len__(self) -> int:
        return self.batches

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """The stream resumes from its restored position, not from a step count."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        windows = self.stream.windows()
        while True:
            batch = torch.tensor([next(windows) for _ in range(self.batch_size)])
            yield {"input": batch[:, :-1], "labels": batch[:, 1:]}


def data_state(loader: Any) -> dict[str, Any]:
    """Every dp rank's stream position for the checkpoint (collective; {} unless streaming)."""
    if not isinstance(loader, StreamLoader):
        return {}
    positions: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(positions, (loader.stream.dp_rank, loader.stream.position._asdict()))
    return {"stream_positions": {str(rank): pos for rank, pos in positions}}


def restore_data_state(loader: Any, saved: dict[str, Any]) -> None:
    """Continue each dp rank's stream where the checkpoint left it (same dp degree only:
    the documents are dealt to ranks by the dp degree)."""
    if not isinstance(loader, StreamLoader):
        return
    positions = saved.get("stream_positions", {})
    if set(positions) != {str(rank) for rank in range(loader.stream.dp_size)}:
        raise ConfigError(f"--streaming resume needs the checkpoint's dp degree "
                          f"({len(positions) or 'not a streaming checkpoint'}), got "
                          f"{loader.stream.dp_size}")
    loader.stream.position = saved_position(positions[str(loader.stream.dp_rank)])


def saved_position(saved: Any) -> Position:
    """A checkpoint's stream position, checked (a hostile file may hold anything): exactly
    Position's fields, each a non-negative int."""
    if not isinstance(saved, dict) or set(saved) != set(Position._fields) or not all(
            type(v) is int and 0 <= v < 2 ** 63 for v in saved.values()):
        raise ConfigError(f"--streaming resume: the checkpoint's stream position is not "
                          f"{len(Position._fields)} non-negative integers "
                          f"({', '.join(Position._fields)})")
    return Position(**saved)


def build_stream_spec(cfg: JobConfig, tokenizer_name: str | None) -> StreamSpec:
    """Pieces of a local source or the hub dataset; the tokenizer is loaded on every rank
    (nothing is cached, so no rank waits on another)."""
    data = cfg.data
    source = resolve_source(data.dataset)
    pieces = [Piece("hub", (source.name,))] if source.kind == "hub" else \
        plan_pieces(source.files, source.builder)
    return StreamSpec(tuple(pieces), data.hf_text_column, data.hf_split,
                      load_tokenizer(tokenizer_name, cfg.model.trust_remote_code), data.seq_len,
                      batches=(cfg.train.max_steps or 0) * cfg.train.grad_accum_steps)
