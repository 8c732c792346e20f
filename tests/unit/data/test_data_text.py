"""Text data: sources, tokenizers, the token cache, packing and masking (one process)."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from loom.config import ConfigError, config_from_flags
from loom.config.resolved import Facts, applied
from loom.data import text
from loom.data.hub import looks_like_hub_id
from loom.data.loaders import build_dataloader, build_dataset, tokenizer_vocab
from loom.data.text import PackedTokens, mask_labels, resolve_source, select_rows
from loom.data.tokenizers import SHIPPED_TOKENIZER, load_auto_tokenizer, load_shipped_tokenizer
from loom.losses import IGNORE_INDEX
from tests.one_rank import one_rank_group

DOCS = ["The first document is short.", "A second one, with more words in it than the first.",
        "Third: it has\nseveral lines\n\nand a blank one.", "Fourth and last."]


@pytest.fixture(scope="module")
def process_group():
    """build_dataset coordinates ranks through collectives; one rank suffices here."""
    with one_rank_group():
        yield


@pytest.fixture(scope="module")
def gpt2():
    return load_shipped_tokenizer()


def reference_stream(docs: list[str], tokenizer) -> list[int]:
    """Each document tokenized on its own with the Rust tokenizer, end-of-text after each."""
    out: list[int] = []
    for doc in docs:
        out += [*tokenizer.backend.encode(doc, add_special_tokens=False).ids, tokenizer.eot_id]
    return out


def write_source(kind: str, folder: Path, docs: list[str]) -> Path:
    """The same documents as a .parquet, a .jsonl, or a folder of .txt (one per file)."""
    if kind == "parquet":
        pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), folder / "d.parquet")
        return folder / "d.parquet"
    if kind == "jsonl":
        (folder / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        return folder / "d.jsonl"
    (folder / "txt").mkdir()
    for i, doc in enumerate(docs):
        (folder / "txt" / f"{i:03d}.txt").write_text(doc)
    return folder / "txt"


def data_config(tmp_path: Path, dataset: str | None, seq_len: int = 8, **flags):
    env = {"LOOM_CACHE_DIR": str(tmp_path / "cache"), **flags.pop("environ", {})}
    return config_from_flags({"dataset": dataset, "seq_len": seq_len, "seed": 0, **flags},
                             environ=env)


def stream_of(dataset: PackedTokens) -> list[int]:
    return dataset.stream[:].astype(np.int64).tolist()


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "txt"])
def test_local_sources_tokenize_each_document_then_end_of_text(tmp_path, process_group, gpt2,
                                                                kind):
    cfg = data_config(tmp_path, str(write_source(kind, tmp_path, DOCS)))
    dataset, facts = build_dataset(cfg, local_rank=0)
    assert stream_of(dataset) == reference_stream(DOCS, gpt2)
    assert facts.settings["vocab_size"] == len(gpt2.backend.get_vocab()) == 50257
    assert sum(1 for t in stream_of(dataset) if t == gpt2.eot_id) == len(DOCS)


def test_shipped_tokenizer_matches_autotokenizer_on_the_same_files(tmp_path, gpt2):
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(SHIPPED_TOKENIZER / "tokenizer_config.json", folder)
    (folder / "tokenizer.json").write_bytes(
        gzip.decompress((SHIPPED_TOKENIZER / "tokenizer.json.gz").read_bytes()))
    auto = load_auto_tokenizer(str(folder))
    assert (auto.size, auto.eot_id, auto.pad_id) == (gpt2.size, gpt2.eot_id, gpt2.pad_id)
    assert auto.encode(DOCS) == gpt2.encode(DOCS)
    assert gpt2.encode(["Hello world"]) == [[15496, 995]]  # the published GPT-2 ids


def test_packing_cuts_windows_of_seq_len_plus_one_and_masks_the_padded_tail(tmp_path,
                                                                             process_group):
    cfg = data_config(tmp_path, str(write_source("jsonl", tmp_path, DOCS)), seq_len=8)
    dataset, _ = build_dataset(cfg, local_rank=0)
    stream = stream_of(dataset)
    assert len(dataset) == -(-len(stream) // 9)
    for i in range(len(dataset) - 1):
        sample = dataset[i]
        window = stream[i * 9:(i + 1) * 9]
        assert sample["input"].tolist() == window[:-1]
        assert sample["labels"].tolist() == window[1:]
    tail = dataset[len(dataset) - 1]
    rest = stream[(len(dataset) - 1) * 9:]
    assert tail["input"].shape == tail["labels"].shape == (8,)
    assert tail["labels"][:len(rest) - 1].tolist() == rest[1:]
    assert (tail["labels"][len(rest) - 1:] == IGNORE_INDEX).all()


def test_mask_labels_hides_attention_mask_zeros_and_pad_ids_only():
    labels = torch.tensor([[5, 7, 0, 9, 0], [1, 2, 3, 4, 5]])
    attention = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 1, 1]])
    masked = mask_labels(labels, attention, pad_id=0)
    expected = torch.tensor([[5, 7, -100, 9, -100], [1, 2, -100, 4, 5]])
    torch.testing.assert_close(masked, expected)
    kept = mask_labels(labels, attention, pad_id=None)
    assert kept[0, 2] == 0 and kept[1, 2] == IGNORE_INDEX


def test_hf_limit_picks_the_same_rows_every_run_and_follows_the_seed(tmp_path, process_group,
                                                                     gpt2):
    docs = [f"document number {i} says {i * i}" for i in range(40)]
    path = str(write_source("parquet", tmp_path, docs))
    runs = [stream_of(build_dataset(data_config(tmp_path / f"run{i}", path, hf_limit=7),
                                    local_rank=0)[0]) for i in range(2)]
    reseeded = build_dataset(data_config(tmp_path / "seed", path, hf_limit=7,
                                         environ={"LOOM_HF_LIMIT_SEED": "5"}), 0)[0]
    assert runs[0] == runs[1]
    assert stream_of(reseeded) != runs[0]
    assert runs[0].count(gpt2.eot_id) == 7
    import datasets

    rows = select_rows(datasets.Dataset.from_dict({"i": list(range(40))}), 7, seed=0)["i"]
    assert rows == sorted(rows) and len(set(rows)) == 7
    assert runs[0] == reference_stream([docs[i] for i in rows], gpt2)


def test_second_build_reads_the_cache_and_seq_len_is_not_part_of_the_key(tmp_path,
                                                                         process_group,
                                                                         monkeypatch):
    path = str(write_source("jsonl", tmp_path, DOCS))
    first, _ = build_dataset(data_config(tmp_path, path, seq_len=8), local_rank=0)

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again despite a cache entry")

    monkeypatch.setattr(text, "load_documents", no_tokenizing)
    again, _ = build_dataset(data_config(tmp_path, path, seq_len=4), local_rank=0)
    assert stream_of(again) == stream_of(first) and again.stream.path == first.stream.path
    with pytest.raises(AssertionError, match="tokenized again"):
        build_dataset(data_config(tmp_path, path, hf_text_column="other"), local_rank=0)


def test_loader_workers_yield_the_same_batches(tmp_path, process_group):
    docs = [f"sentence {i} of a longer text that fills windows" for i in range(60)]
    dataset, _ = build_dataset(data_config(tmp_path, str(write_source("jsonl", tmp_path, docs))),
                               local_rank=0)

    def batches(workers: int) -> list[torch.Tensor]:
        loader = build_dataloader(dataset, batch_size=4, dp_rank=0, dp_size=1, seed=3,
                                  num_workers=workers)
        return [b["input"] for b in loader]

    serial, parallel = batches(0), batches(2)
    assert len(serial) == len(dataset) // 4
    for a, b in zip(serial, parallel, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(("kind", "flags", "message"), [
    ("parquet", dict(hf_text_column="body"), "--hf-text-column body not in .*columns: text, n"),
    ("parquet", dict(hf_text_column="n"), "--hf-text-column n .* holds int64, not text"),
    ("parquet", dict(hf_split="validation"), "--hf-split validation not in .*splits: train"),
    ("txt", dict(hf_text_column="body"), "--hf-text-column body not in .*columns: text$"),
    ("txt", dict(hf_split="validation"), "--hf-split validation not in .*splits: train$"),
])
def test_missing_column_or_split_names_what_exists(tmp_path, process_group, kind, flags,
                                                    message):
    cfg = data_config(tmp_path, str(write_source(kind, tmp_path, DOCS)), **flags)
    with pytest.raises(ConfigError, match=message):
        build_dataset(cfg, local_rank=0)


def test_bad_local_paths_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file or folder"):
        resolve_source(str(tmp_path / "missing.jsonl"))
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.jsonl").write_text("{}")
    with pytest.raises(ConfigError, match=r"mixes formats \(json, text\)"):
        resolve_source(str(tmp_path))
    (tmp_path / "c.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="expected .txt, .jsonl"):
        resolve_source(str(tmp_path / "c.bin"))
    assert resolve_source("owner/name").kind == "hub"
    assert resolve_source(None).kind == "embedded"
    assert looks_like_hub_id("gpt2", bare_ok=True) and not looks_like_hub_id("gpt2")
    assert not looks_like_hub_id("./gpt2", bare_ok=True)


def test_vocab_is_sized_from_the_tokenizer_with_one_recorded_warning(tmp_path):
    cfg = data_config(tmp_path, None, vocab_size=1000)
    facts = tokenizer_vocab(cfg, {"vocab_size": 50257, "tokenizer": "gpt2"})
    resized = applied(cfg, facts)
    assert resized.model.vocab_size == 50257
    assert len(resized.warnings) == len(cfg.warnings) + 1
    assert "--vocab-size 1000 replaced by 50257" in resized.warnings[-1]
    assert tokenizer_vocab(resized, {"vocab_size": 50257, "tokenizer": "gpt2"}) == Facts()


def test_vocab_not_given_is_sized_from_the_tokenizer_without_a_warning(tmp_path):
    cfg = data_config(tmp_path, None)
    facts = tokenizer_vocab(cfg, {"vocab_size": 50257, "tokenizer": "gpt2"})
    assert facts == Facts({"vocab_size": 50257})
    resized = applied(cfg, facts)
    assert resized.model.vocab_size == 50257 and resized.warnings == cfg.warnings


def test_shipped_tokenizer_has_a_name_and_tokenizer_errors_are_whole(tmp_path):
    from loom.data.tokenizers import SHIPPED_FLAG, load_auto_tokenizer, tokenizer_name

    assert tokenizer_name(SHIPPED_FLAG, None) is None  # None selects the shipped tokenizer
    assert tokenizer_name(SHIPPED_FLAG, "org/model") is None
    pytest.importorskip("transformers")
    (tmp_path / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "PreTrainedTokenizerFast"}')  # no tokenizer.json beside it
    with pytest.raises(ConfigError) as error:
        load_auto_tokenizer(str(tmp_path))
    message = str(error.value)
    assert "\n" not in message and "from one of: (1)" in message and "(3)" in message


def test_a_document_without_line_breaks_is_read_and_encoded_in_bounded_blocks(
        tmp_path, gpt2, monkeypatch):
    """A .txt document is read and encoded a block at a time (loom tokenize's reader), not
    whole: every read and every tokenizer call is bounded, and the tokens are the whole's."""
    from loom.data import documents

    words = [f"word{i % 97}" + ("," if i % 7 == 0 else "") for i in range(40_000)]
    whole = " ".join(words)  # ~300k characters, one line
    (tmp_path / "one.txt").write_text(whole)
    block, reads, encoded = 8192, [], []
    open_binary, encode = documents.open_binary, gpt2.encode

    class Recorded:
        def __init__(self, stream):
            self.stream = stream

        def read(self, size=-1):
            reads.append(size)
            return self.stream.read(size)

        def __getattr__(self, name):
            return getattr(self.stream, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.stream.close()

    def recorded_open(path):
        stream, raw = open_binary(path)
        return Recorded(stream), raw

    class RecordedTokenizer:
        size, eot_id = gpt2.size, gpt2.eot_id

        def encode(self, texts):
            encoded.append(sum(map(len, texts)))
            return encode(texts)

    monkeypatch.setattr(documents, "open_binary", recorded_open)
    tokens = text.tokenize_text_files([tmp_path / "one.txt"], RecordedTokenizer(),
                                      block_chars=block)
    assert len(reads) > len(whole) // block and 0 < max(reads) <= block
    assert max(encoded) <= 2 * block + 1024, max(encoded)  # a batch of fragments
    assert tokens.tolist() == [*encode([whole])[0], gpt2.eot_id]


def test_txt_files_tokenize_as_the_whole_document_path_does(tmp_path, gpt2):
    """The blockwise .txt path against `datasets`' whole documents: the same tokens, an
    empty file adding nothing; --hf-limit picks the same files."""
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, doc in enumerate([*DOCS, "", " trailing space \n\n"]):
        (folder / f"{i}.txt").write_text(doc)
    source = resolve_source(str(folder))
    docs = text.load_documents(source, "train", tmp_path / "cache")
    assert text.tokenize_text_files(list(source.files), gpt2).tolist() == \
        text.tokenize(docs, "text", gpt2).tolist()
    picked = select_rows(docs, 3, 7)
    cfg = data_config(tmp_path, str(folder), hf_limit=3, hf_limit_seed=7).data
    assert [p.read_text() for p in text.text_files(source, cfg)] == picked["text"]


def test_a_streamed_document_is_encoded_in_fragments_with_the_whole_ones_tokens(gpt2):
    """--streaming encodes a long document a fragment at a time (no tokenizer call sees
    more than a block), with the tokens of the whole."""
    from loom.data.documents import encode_document

    whole = " ".join(f"word{i % 89}" + ("." if i % 11 == 0 else "") for i in range(20_000))
    calls: list[int] = []

    def encode(texts):
        calls.append(max(map(len, texts)))
        return gpt2.encode(texts)

    assert encode_document(whole, encode, 4096) == gpt2.encode([whole])[0]
    assert len(calls) > len(whole) // 4096 and max(calls) <= 2 * 4096, max(calls)
