"""Distributed sampling in one global order, and the synthetic random-token dataset.

Step k of an epoch consumes global samples k*G ... k*G+G-1 (G = global batch) of one seeded
permutation; dp rank r takes its contiguous slice of B = G / dp. Ranks that differ only in
tp get the same slice, and a run on another dp degree with the same G sees the same data.
`build_dataset` makes the dataset itself: synthetic, or text tokenized once per node.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Sampler

from loom.config import ConfigError, JobConfig
from loom.config.mixture import parse_mixture
from loom.config.resolved import Facts
from loom.config.valsets import DEFAULT_SET, naming_val_dataset, val_sets
from loom.data.cache import TokenCache, cache_key, default_cache_dir
from loom.data.chat import ChatTokens, encode_chat, held_out, is_chat_source
from loom.data.mixture import Mixture
from loom.data.shards import ShardStream, is_shard_folder, read_manifest
from loom.data.split import held_out_cut
from loom.data.streaming import PackedStream, StreamLoader, StreamSpec, build_stream_spec
from loom.data.text import (
    PackedTokens,
    TextSource,
    TokenStream,
    cache_parts,
    prepare_tokens,
    resolve_source,
)
from loom.data.tokenizers import load_tokenizer, tokenizer_name

logger = logging.getLogger("loom")

RANDOM_DATASET_SAMPLES = 8192
"""Length of the synthetic dataset: an epoch of `random` is this many samples."""
RANDOM_EOT_ID = 0
"""The synthetic data's end-of-text: its most frequent id (about one token in seven at a
512 vocabulary), so --doc-mask has many short documents to keep apart."""


class RandomTokens(Dataset):
    """Synthetic tokens with Zipf-like frequencies, as in natural text, so the loss has
    somewhere to fall. Sample i is a pure function of (seed, i): every mesh sees identical
    data without any I/O."""

    eot_id = RANDOM_EOT_ID

    def __init__(self, vocab_size: int, seq_len: int, seed: int,
                 num_samples: int = RANDOM_DATASET_SAMPLES):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.num_samples = num_samples
        self.probs = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed((self.seed * 7_919 + index) % 2**64)
        window = torch.multinomial(self.probs, self.seq_len + 1, replacement=True,
                                   generator=gen)
        return {"input": window[:-1], "labels": window[1:]}


class GlobalOrderSampler(Sampler[int]):
    """Yields this dp rank's indices, batch after batch, from one seeded global permutation."""

    def __init__(self, dataset_size: int, batch_size: int, dp_rank: int, dp_size: int,
                 seed: int, shuffle: bool = True, continuing: bool = False):
        """`continuing`: positions in order, epoch after epoch without a gap (epoch e
        starts at position e x the samples an epoch takes), for a dataset whose windows
        are a function of the global position (`loom.data.mixture`): sample n of the run
        is position n, whatever the epoch length."""
        self.continuing = continuing
        self.dataset_size, self.batch_size = dataset_size, batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle, self.epoch, self.start_step = seed, shuffle, 0, 0

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.dp_size

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset_size // self.global_batch

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Iterate `epoch`'s order from step `start_step` on (a resumed run passes the
        number of steps of this epoch it has already taken)."""
        self.epoch, self.start_step = epoch, start_step

    def __len__(self) -> int:
        return max(0, self.steps_per_epoch - self.start_step) * self.batch_size

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            gen = torch.Generator().manual_seed((self.seed + 1_000_003 * self.epoch) % 2**64)
            order = torch.randperm(self.dataset_size, generator=gen)
        else:
            order = torch.arange(self.dataset_size)
        if self.continuing:
            order = order + self.epoch * self.steps_per_epoch * self.global_batch
        start = self.dp_rank * self.batch_size
        for step in range(self.start_step, self.steps_per_epoch):
            base = step * self.global_batch + start
            yield from order[base:base + self.batch_size].tolist()


def build_dataloader(dataset: Dataset, *, batch_size: int, dp_rank: int, dp_size: int,
                     seed: int, num_workers: int, shuffle: bool = True,
                     ) -> DataLoader | StreamLoader:
    """A loader that drops the ragged tail in sampler and loader alike (ragged shapes force
    recompiles); fails when that leaves no full batch for this rank."""
    if isinstance(dataset, StreamSpec):
        return StreamLoader(PackedStream(dataset, dp_rank, dp_size), batch_size, dataset.batches)
    ordered = bool(getattr(dataset, "ordered", False))  # a mixture: its own schedule
    sampler = GlobalOrderSampler(len(dataset), batch_size, dp_rank, dp_size, seed,
                                 shuffle and not ordered, continuing=ordered)
    if sampler.steps_per_epoch == 0:
        raise ConfigError(
            f"zero full batches on this rank: dataset has {len(dataset)} samples but one "
            f"step needs batch size {batch_size} x dp degree {dp_size} = "
            f"{sampler.global_batch}; lower --batch-size, use fewer data-parallel ranks "
            "(--dp-shard/--dp-replicate or more --tp), shorten --seq-len or add data")
    # Its own generator: each iterator draws a worker seed, which from the global RNG would
    # move torch's random state by how often the loop started an epoch or was resumed.
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True,
                      num_workers=num_workers, persistent_workers=num_workers > 0,
                      generator=torch.Generator().manual_seed(seed))


def end_of_text(dataset: Dataset | StreamSpec) -> int:
    """The end-of-text id between the dataset's packed documents (--doc-mask splits there)."""
    if isinstance(dataset, StreamSpec):
        return dataset.tokenizer.eot_id
    return int(dataset.eot_id)


def build_dataset(cfg: JobConfig, local_rank: int) -> tuple[Dataset, Facts]:
    """The training dataset, and what it says of the configuration (the vocabulary its
    tokenizer sizes)."""
    train, _, facts = build_datasets(cfg, local_rank)
    return train, facts


ValSets = dict[str, Dataset]
"""The validation sets by name (`loom.config.valsets`; the default set's name is "")."""


def build_datasets(cfg: JobConfig, local_rank: int,
                   ) -> tuple[Dataset | StreamSpec, ValSets, Facts]:
    """(training set, validation sets, the facts the data decides: the vocabulary its
    tokenizer sizes, --doc-mask for conversations). A --val-fraction
    holds out the tail of the training tokens, cut between documents (the default set);
    each --val-dataset is read with the training set's tokenizer;
    --streaming gives a stream spec that `build_dataloader` deals out to the dp ranks; a
    JSONL file of conversations is chat data (`chat_datasets`)."""
    data, ev = cfg.data, cfg.eval
    if data.dataset == "random":
        train = RandomTokens(cfg.model.vocab_size, data.seq_len, cfg.train.seed)
        val = {DEFAULT_SET: RandomTokens(cfg.model.vocab_size, data.seq_len, cfg.train.seed + 1,
                                         max(1, round(len(train) * ev.val_fraction)))} \
            if ev.val_fraction else {}
        return train, val, Facts()
    if parse_mixture(data.dataset) is not None:
        return mixture_datasets(cfg, local_rank)
    source = None if data.dataset is None or is_shard_folder(data.dataset) else \
        resolve_source(data.dataset)
    if source is not None and is_chat_source(source):
        return chat_datasets(cfg, source)
    if data.streaming:
        spec = build_stream_spec(cfg, tokenizer_name(data.tokenizer_name, cfg.model.model))
        val = {name: PackedTokens(*token_stream(path, cfg, local_rank)[:2], data.seq_len)
               for name, path in val_sets(ev).items()}
        tok = spec.tokenizer
        return spec, val, tokenizer_vocab(cfg, {"vocab_size": tok.size, "tokenizer": tok.name})
    stream, meta, name = token_stream(data.dataset, cfg, local_rank)
    span = (0, len(stream))
    val: ValSets = {}
    if ev.val_fraction:
        cut = held_out_cut(stream, meta["eot_id"], ev.val_fraction)
        span = (0, cut)
        val[DEFAULT_SET] = PackedTokens(stream, meta, data.seq_len, (cut, len(stream)))
    val.update(text_val_sets(cfg, meta, local_rank))
    train = PackedTokens(stream, meta, data.seq_len, span)
    logger.info("data: %s, %d tokens, %d windows of %d tokens%s", name, train.n_tokens,
                len(train), data.seq_len + 1, validation_note(val))
    return train, val, tokenizer_vocab(cfg, meta)


def same_tokenizer(meta: dict, other: dict, what: str) -> None:
    """Data read together must share ids: one vocabulary and end-of-text."""
    if (other["vocab_size"], other["eot_id"]) != (meta["vocab_size"], meta["eot_id"]):
        raise ConfigError(f"{what} was tokenized with {other['tokenizer']}, --dataset with "
                          f"{meta['tokenizer']}")


def text_val_sets(cfg: JobConfig, meta: dict, local_rank: int) -> ValSets:
    """Each --val-dataset as packed tokens, checked against the training data's tokenizer."""
    sets: ValSets = {}
    for set_name, path in val_sets(cfg.eval).items():
        with naming_val_dataset():
            val_stream, val_meta, _ = token_stream(path, cfg, local_rank)
        same_tokenizer(meta, val_meta, f"--val-dataset {path}")
        sets[set_name] = PackedTokens(val_stream, val_meta, cfg.data.seq_len)
    return sets


def mixture_datasets(cfg: JobConfig, local_rank: int) -> tuple[Mixture, ValSets, Facts]:
    """A --dataset mixture: each source (text, JSONL or shards, never chat) packed as one
    dataset would be, all with one tokenizer, dealt by `loom.data.mixture`'s schedule."""
    data, spec = cfg.data, parse_mixture(cfg.data.dataset) or []
    sources, metas = [], []
    for path, _ in spec:
        if not is_shard_folder(path) and is_chat_source(resolve_source(path)):
            raise ConfigError(f"--dataset mixture: {path} holds conversations; a mixture is "
                              "of pretraining text")
        stream, meta, _ = token_stream(path, cfg, local_rank)
        if metas:
            same_tokenizer(metas[0], meta, f"mixture source {path}")
        sources.append(PackedTokens(stream, meta, data.seq_len))
        metas.append(meta)
    mix = Mixture([p for p, _ in spec], sources, [w for _, w in spec],
                  data.mixture_exhausted, cfg.train.seed)
    val = text_val_sets(cfg, metas[0], local_rank)
    logger.info("data: mixture of %s; %d windows of %d tokens per epoch (--mixture-exhausted "
                "%s)%s", ", ".join(f"{p} ({float(w):.3g}: {len(s)} windows)" for (p, w), s
                                   in zip(spec, sources, strict=True)),
                len(mix), data.seq_len + 1, data.mixture_exhausted, validation_note(val))
    return mix, val, tokenizer_vocab(cfg, metas[0])


def validation_note(val: ValSets) -> str:
    """'; validation 1200 tokens, code 800 tokens' for the start-up line ('' without)."""
    sizes = [f"{name or 'validation'} {v.n_tokens} tokens" for name, v in val.items()]
    return f"; {', '.join(sizes)}" if sizes else ""


def chat_datasets(cfg: JobConfig, source: TextSource,
                  ) -> tuple[ChatTokens, ValSets, Facts]:
    """Conversations (chat.py) as (training set, validation sets, the vocabulary the
    tokenizer sizes, and --doc-mask on: a window packs several conversations, and none may
    see another). A --val-fraction holds out whole conversations at the end."""
    data, ev, m = cfg.data, cfg.eval, cfg.model
    hf = m.runs_transformers
    if data.streaming:
        raise ConfigError(f"--dataset {source.name} holds conversations, which are read "
                          "whole, not streamed; drop --streaming")
    tokenizer = load_tokenizer(tokenizer_name(data.tokenizer_name, m.model),
                               m.trust_remote_code)
    corpus = encode_chat(source.files, tokenizer, source.name)
    train_part, val = (0, len(corpus.ends)), {}
    if ev.val_fraction:
        cut = held_out(corpus, ev.val_fraction)
        train_part = (0, cut)
        val[DEFAULT_SET] = ChatTokens(corpus, tokenizer.eot_id, data.seq_len,
                                      (cut, len(corpus.ends)))
    for set_name, path in val_sets(ev).items():
        with naming_val_dataset():
            val_source = resolve_source(path)
        if not is_chat_source(val_source):
            raise ConfigError(f"--val-dataset {path} holds no conversations but "
                              f"--dataset {source.name} does; give both in one format")
        val[set_name] = ChatTokens(encode_chat(val_source.files, tokenizer, val_source.name),
                                   tokenizer.eot_id, data.seq_len)
    train = ChatTokens(corpus, tokenizer.eot_id, data.seq_len, train_part)
    logger.info("data: %s, %d conversations, %d tokens (%d trained on), %d windows of %d "
                "tokens%s", source.name, train.n_conversations, train.n_tokens,
                int(train.trained.sum()), len(train), data.seq_len + 1,
                "".join(f"; {name or 'validation'} {v.n_conversations} conversations"
                        for name, v in val.items()))
    facts = tokenizer_vocab(cfg, {"vocab_size": tokenizer.size, "tokenizer": tokenizer.name})
    if hf:
        logger.warning("chat data under transformers' module for %s: conversations are "
                       "packed without --doc-mask (it needs loom's own model)", m.model)
        return train, val, facts
    return train, val, facts.and_(Facts({"doc_mask": True}))


def token_stream(dataset: str | None, cfg: JobConfig, local_rank: int,
                 ) -> tuple[TokenStream, dict, str]:
    """(tokens, metadata, name) of a shard folder from `loom tokenize` (memory-mapped, no
    rank waits), or of text tokenized once per node into the cache (local rank 0
    tokenizes while the other ranks wait, so N ranks never tokenize the same data)."""
    if dataset is not None and is_shard_folder(dataset):
        folder = Path(dataset).expanduser()
        manifest = read_manifest(folder)
        return ShardStream(folder, manifest), manifest, str(folder)
    data = cfg.data
    source = resolve_source(dataset)
    tokenizer = tokenizer_name(data.tokenizer_name, cfg.model.model)
    root = Path(data.cache_dir).expanduser() if data.cache_dir else default_cache_dir()
    cache = TokenCache(root, cache_key(cache_parts(source, data, tokenizer)))
    on_node_leaders(lambda: prepare_tokens(cache, source, data, tokenizer, root,
                                           cfg.model.trust_remote_code),
                    leader=local_rank == 0)
    return cache.stream(), cache.meta(), source.name


def on_node_leaders(fn: Callable[[], None], leader: bool) -> None:
    """Run `fn` where `leader` is true while the other ranks wait. A failure there is raised
    on every rank (a ConfigError stays one line), so no rank is left waiting forever."""
    error: Exception | None = None
    if leader:
        try:
            fn()
        except Exception as e:
            error = e
    outcomes: list[tuple[bool, str] | None] = [None] * dist.get_world_size()
    mine = None if error is None else (isinstance(error, ConfigError), str(error))
    dist.all_gather_object(outcomes, mine)
    if error is not None:
        raise error
    failures = [(rank, o) for rank, o in enumerate(outcomes) if o is not None]
    if failures:
        rank, (is_config, message) = failures[0]
        if is_config:
            raise ConfigError(message)
        raise RuntimeError(f"preparing the data failed on rank {rank}: {message}")


def tokenizer_vocab(cfg: JobConfig, meta: dict) -> Facts:
    """The vocabulary size the tokenizer needs: the embedding must cover every id it emits,
    added special tokens too (none where `cfg`'s already does, or the model's is given)."""
    size = int(meta["vocab_size"])
    if size == cfg.model.vocab_size:
        return Facts()
    if cfg.model.from_hub_format:  # its embedding is given
        if size > cfg.model.vocab_size:
            raise ConfigError(f"tokenizer {meta['tokenizer']} has {size} tokens but the model "
                              f"{cfg.model.model} embeds only {cfg.model.vocab_size}")
        return Facts()
    if "vocab_size" not in cfg.explicit:  # the default or a preset's: sizing it is no news
        return Facts({"vocab_size": size})
    warning = (f"--vocab-size {cfg.model.vocab_size} replaced by {size}, the full length of "
               f"tokenizer {meta['tokenizer']} (special tokens included)")
    logger.warning(warning)
    return Facts({"vocab_size": size}, (warning,))
