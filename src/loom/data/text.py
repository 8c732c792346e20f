"""Text to training windows: find the documents (embedded corpus, local files, hub dataset),
subsample, tokenize once into the cache, then serve windows of seq_len + 1 tokens.

.txt files (each one document) are read and tokenized in bounded pieces, as `loom tokenize`
reads them, so a document of any length costs a block of text at a time; other formats go
through `datasets`, imported (with `pyarrow`) only when they must be tokenized, so a warm
start (cache hit) costs a memory map and no library imports.
"""

from __future__ import annotations

import copy
import logging
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np
import torch
from torch.utils.data import Dataset

from loom.config import ConfigError, DataConfig
from loom.data.cache import TokenCache, files_fingerprint, token_dtype
from loom.data.documents import PieceReader
from loom.data.hub import (
    LOCAL_FILES_HINT,
    ensure_hub_reachable,
    first_line,
    hub_offline,
    looks_like_hub_id,
)
from loom.data.labels import IGNORE_INDEX
from loom.data.pieces import plan_pieces
from loom.data.tokenizers import ASSETS, TextTokenizer, load_tokenizer, tokenizer_identity
from loom.data.workers import BLOCK_CHARS, batches, encode_batch
from loom.safe_io import describe_kind

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger("loom")

EMBEDDED_CORPUS = ASSETS / "corpus"
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet",
            ".csv": "csv"}
"""Local file suffix -> `datasets` builder (.gz and .zst are read through for text, json and
csv)."""
ENCODE_BATCH = 1000
"""Documents per tokenizer call: big enough for the Rust tokenizer to use every core."""


class TokenStream(Protocol):
    """A flat, read-only token sequence that can be sliced (memory-mapped, never loaded)."""

    def __len__(self) -> int: ...

    def __getitem__(self, window: slice) -> np.ndarray: ...


@dataclass(frozen=True)
class TextSource:
    """Where the documents come from. A .txt file is one document."""

    kind: str
    """'embedded', 'local' or 'hub'."""
    name: str
    files: tuple[Path, ...] = ()
    builder: str = "text"

    def identity(self) -> str:
        if self.kind == "hub":
            return f"hub:{self.name}"
        return f"{self.kind}:{files_fingerprint(self.files)}"


def builder_for(path: Path) -> str | None:
    """The `datasets` builder that reads this file, None if it is not a data file."""
    name = path.name.lower()
    inner = name.removesuffix(".gz").removesuffix(".zst")
    builder = BUILDERS.get(Path(inner).suffix)
    return None if builder == "parquet" and inner != name else builder


def resolve_source(dataset: str | None) -> TextSource:
    if dataset is None:
        return TextSource("embedded", "embedded corpus", tuple(sorted(EMBEDDED_CORPUS.iterdir())))
    path = Path(dataset).expanduser()
    if path.exists():
        return local_source(path)
    if looks_like_hub_id(dataset) and builder_for(path) is None:
        return TextSource("hub", dataset)
    raise ConfigError(f"--dataset {dataset}: no such file or folder, and not a hub id "
                      "(owner/name)")


def local_source(path: Path) -> TextSource:
    """A file, or every data file under a folder (hidden ones skipped); one format only."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and builder_for(p)
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
    else:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):  # a FIFO would block the reader, a device never end
            raise ConfigError(f"--dataset {path} is {describe_kind(mode)}, not a regular file")
        files = [path]
    builders = {builder_for(p) for p in files}
    if not files or None in builders:
        raise ConfigError(f"--dataset {path}: expected .txt, .jsonl, .json, .parquet or .csv "
                          "files (optionally .gz or .zst, except parquet)")
    if len(builders) > 1:
        raise ConfigError(f"--dataset {path} mixes formats ({', '.join(sorted(builders))}); "
                          "point it at files of one kind")
    return TextSource("local", str(path.resolve()), tuple(p.resolve() for p in files),
                      builders.pop())


def cache_parts(source: TextSource, data: DataConfig, tokenizer_name: str | None,
                ) -> dict[str, Any]:
    """What the tokens depend on, hence the cache key (seq_len is not: windows are cut
    when reading, so one entry serves every sequence length)."""
    return {"source": source.identity(), "split": data.hf_split,
            "column": data.hf_text_column, "limit": data.hf_limit,
            "limit_seed": data.hf_limit_seed if data.hf_limit else None,
            "tokenizer": tokenizer_identity(tokenizer_name)}


def load_documents(source: TextSource, split: str, cache_dir: Path) -> datasets.Dataset:
    """One split of the source as a `datasets.Dataset`; errors name what exists."""
    import datasets
    from datasets.exceptions import DatasetsError

    datasets.disable_progress_bars()
    try:
        if source.kind == "hub":
            splits = datasets.load_dataset(source.name)
        else:
            kwargs = {"sample_by": "document"} if source.builder == "text" else {}
            splits = datasets.load_dataset(source.builder, data_files=[str(f) for f in
                                                                       source.files],
                                           cache_dir=str(cache_dir / "datasets"), **kwargs)
    except (OSError, ValueError, DatasetsError) as e:
        offline = ", HF_HUB_OFFLINE is set" if source.kind == "hub" and hub_offline() else ""
        raise ConfigError(f"--dataset {source.name}: cannot load it ({first_line(e)}"
                          f"{offline}); {LOCAL_FILES_HINT}") from None
    if split not in splits:
        raise ConfigError(f"--hf-split {split} not in --dataset {source.name}; "
                          f"splits: {', '.join(splits)}")
    return splits[split]


def chosen_rows(count: int, limit: int, seed: int) -> np.ndarray | None:
    """`limit` of `count` rows drawn without replacement from `seed`, in their original
    order; None when all are kept."""
    if limit <= 0 or limit >= count:
        return None
    return np.sort(np.random.default_rng(seed).choice(count, size=limit, replace=False))


def select_rows(docs: datasets.Dataset, limit: int, seed: int) -> datasets.Dataset:
    """`limit` rows drawn without replacement from `seed`, kept in their original order."""
    rows = chosen_rows(len(docs), limit, seed)
    return docs if rows is None else docs.select(rows)


def check_text_column(docs: datasets.Dataset, column: str, source: str) -> None:
    columns = ", ".join(docs.column_names)
    feature = docs.features.get(column)
    if feature is None:
        raise ConfigError(f"--hf-text-column {column} not in --dataset {source}; "
                          f"columns: {columns}")
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise ConfigError(f"--hf-text-column {column} of --dataset {source} holds "
                          f"{getattr(feature, 'dtype', feature)}, not text; columns: {columns}")


def _encode_batch(batch: dict[str, list], column: str, tokenizer: TextTokenizer,
                  ) -> dict[str, list[list[int]]]:
    texts = [text for text in batch[column] if text]
    return {"ids": [[*ids, tokenizer.eot_id] for ids in tokenizer.encode(texts)]}


def tokenize(docs: datasets.Dataset, column: str, tokenizer: TextTokenizer) -> np.ndarray:
    """Every non-empty document's tokens followed by end-of-text, as one flat array."""
    import pyarrow.compute as pc

    encoded = docs.map(_encode_batch, fn_kwargs=dict(column=column, tokenizer=tokenizer),
                       batched=True, batch_size=ENCODE_BATCH, remove_columns=docs.column_names,
                       keep_in_memory=True, new_fingerprint="loom-tokenize",
                       num_proc=None if tokenizer.parallel else os.cpu_count())
    if "ids" not in encoded.column_names:  # no document held any text
        return np.zeros(0, dtype=token_dtype(tokenizer.size))
    flat = pc.list_flatten(encoded.data.table.column("ids")).to_numpy()
    return flat.astype(token_dtype(tokenizer.size))


def prepare_tokens(cache: TokenCache, source: TextSource, data: DataConfig,
                   tokenizer_name: str | None, cache_dir: Path,
                   trust_remote_code: bool = False) -> None:
    """Tokenize the source into `cache` unless an earlier run already did
    (`trust_remote_code`: --trust-remote-code, for a tokenizer that ships code)."""
    if cache.exists():
        return
    start = time.perf_counter()
    if source.kind == "hub":  # fail in seconds, before slow imports and downloads
        ensure_hub_reachable(source.name, "dataset", "--dataset", LOCAL_FILES_HINT)
    tokenizer = load_tokenizer(tokenizer_name, trust_remote_code)
    if source.kind != "hub" and source.builder == "text":
        files = text_files(source, data)
        tokens, documents = tokenize_text_files(files, tokenizer), len(files)
    else:
        docs = load_documents(source, data.hf_split, cache_dir)
        check_text_column(docs, data.hf_text_column, source.name)
        docs = select_rows(docs, data.hf_limit, data.hf_limit_seed)
        tokens, documents = tokenize(docs, data.hf_text_column, tokenizer), len(docs)
    if tokens.size == 0:
        raise ConfigError(f"--dataset {source.name}: column {data.hf_text_column} holds no text")
    cache.write(tokens, {"source": source.name, "split": data.hf_split,
                         "column": data.hf_text_column, "documents": documents,
                         "tokenizer": tokenizer.name, "vocab_size": tokenizer.size,
                         "eot_id": tokenizer.eot_id, "pad_id": tokenizer.pad_id,
                         "n_tokens": int(tokens.size)})
    logger.info("data: tokenized %d documents of %s into %d tokens in %.1f s (cache %s)",
                documents, source.name, tokens.size, time.perf_counter() - start, cache.path)


def text_files(source: TextSource, data: DataConfig) -> list[Path]:
    """The .txt files to tokenize, each one document with one column, `text`, in one split,
    `train` (what `datasets`' text builder would make of them), subsampled by --hf-limit."""
    if data.hf_split != "train":
        raise ConfigError(f"--hf-split {data.hf_split} not in --dataset {source.name}; "
                          "splits: train")
    if data.hf_text_column != "text":
        raise ConfigError(f"--hf-text-column {data.hf_text_column} not in --dataset "
                          f"{source.name}; columns: text")
    rows = chosen_rows(len(source.files), data.hf_limit, data.hf_limit_seed)
    return list(source.files) if rows is None else [source.files[i] for i in rows]


def tokenize_text_files(files: list[Path], tokenizer: TextTokenizer,
                        block_chars: int = BLOCK_CHARS) -> np.ndarray:
    """Each file's tokens followed by end-of-text (an empty file adds none), read and
    encoded `block_chars` characters at a time by `loom tokenize`'s reader (PieceReader):
    a document with no line break costs a block, not its length, and its tokens are those
    of the whole (the reader cuts only where the tokenizer splits anyway)."""
    dtype, parts = token_dtype(tokenizer.size), []
    for piece in plan_pieces(tuple(files), "text"):
        reader = PieceReader(piece, "text", block_chars, tokenizer.encode)
        parts += [encode_batch(batch, tokenizer, dtype)
                  for batch in batches(_without_empty(reader), block_chars)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _without_empty(fragments: Iterator[tuple[str, bool]]) -> Iterator[tuple[str, bool]]:
    """The (fragment, ends a document) pairs, less the end of a document that held no text
    (the whole-document path skips empty documents: no lone end-of-text)."""
    held = False
    for text, ends in fragments:
        held = held or bool(text)
        if text or (ends and held):
            yield text, ends
        if ends:
            held = False


def mask_labels(labels: torch.Tensor, attention_mask: torch.Tensor,
                pad_id: int | None) -> torch.Tensor:
    """-100 where the attention mask is 0 or the label is the pad id, in one pass."""
    ignore = attention_mask == 0
    if pad_id is not None:
        ignore |= labels == pad_id
    return labels.masked_fill(ignore, IGNORE_INDEX)


def window_count(n_tokens: int, width: int, stride: int) -> int:
    """Windows of `width` tokens every `stride` tokens that cover `n_tokens`: apart (stride =
    width, training's packing) or overlapping by one (stride = width - 1, evaluation's: every
    token after the first is a label exactly once)."""
    return max(1, -(-(n_tokens - (width - stride)) // stride)) if n_tokens else 0


class TokenWindows(Dataset):
    """Windows of seq_len + 1 tokens every `stride` tokens over `n_tokens` tokens: apart
    (stride seq_len + 1) for training, overlapping by one (`for_evaluation()`) so no token
    goes unscored. A subclass fills window `index` from `span(index)`."""

    seq_len: int
    n_tokens: int
    stride: int

    def for_evaluation(self: Windows) -> Windows:
        view = copy.copy(self)
        view.stride = self.seq_len
        return view

    def __len__(self) -> int:
        return window_count(self.n_tokens, self.seq_len + 1, self.stride)

    def span(self, index: int) -> tuple[int, int]:
        """[first, last) of window `index`, counted from the first token; the last window's
        may be short (the caller pads it)."""
        first = index * self.stride
        return first, min(first + self.seq_len + 1, self.n_tokens)


Windows = TypeVar("Windows", bound=TokenWindows)


class PackedTokens(TokenWindows):
    """Consecutive windows of seq_len + 1 tokens over tokens [start, end) of a stream (the
    cache's memory-mapped array or the shards): input = w[:-1], labels = w[1:], both exactly
    seq_len long. The tail shorter than a window is padded and masked. `for_evaluation()`:
    the same tokens in windows overlapping by one, so no token goes unscored."""

    def __init__(self, stream: TokenStream, meta: dict[str, Any], seq_len: int,
                 span: tuple[int, int] | None = None):
        self.stream, self.seq_len, self.meta = stream, seq_len, meta
        self.start, end = span or (0, len(stream))
        self.n_tokens = end - self.start
        self.pad_id: int | None = meta["pad_id"]
        self.eot_id = int(meta["eot_id"])
        self.stride = seq_len + 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        width = self.seq_len + 1
        first, last = self.span(index)
        chunk = torch.from_numpy(self.stream[self.start + first:self.start + last]
                                 .astype(np.int64))
        window = torch.full((width,), self.meta["eot_id"] if self.pad_id is None else
                            self.pad_id, dtype=torch.int64)
        window[:len(chunk)] = chunk
        attention_mask = torch.arange(width) < len(chunk)
        return {"input": window[:-1],
                "labels": mask_labels(window[1:], attention_mask[1:], self.pad_id)}
