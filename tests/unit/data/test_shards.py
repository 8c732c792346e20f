"""`loom tokenize` shards: the token stream, fixed shard sizes, checksums, resume after an
interruption, windows across shard boundaries, and the document-aligned validation cut."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest

from loom.commands import tokenize as tok
from loom.config import ConfigError
from loom.data import pieces as piece_plan
from loom.data.shards import ShardStream, read_manifest
from loom.data.split import held_out_cut
from loom.data.text import PackedTokens
from loom.data.tokenizers import load_shipped_tokenizer

SHARD_TOKENS = 1000


def corpus(n: int = 300) -> list[str]:
    rng = random.Random(0)
    words = ["the", "of", "and", "a", "to", "in", "is", "was", "he", "it", "with", "as"]
    return [f"doc {i}: " + " ".join(rng.choices(words, k=rng.randint(5, 60))) for i in range(n)]


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def reference(docs: list[str]) -> list[int]:
    tokenizer = load_shipped_tokenizer()
    return [t for ids in tokenizer.encode(docs) for t in (*ids, tokenizer.eot_id)]


def shard_tokens(out: Path) -> list[int]:
    manifest = read_manifest(out)
    return ShardStream(out, manifest)[:].astype(np.int64).tolist()


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("tok")
    docs = corpus()
    tok.tokenize(str(write_jsonl(root / "docs.jsonl", docs)), root / "out", jobs=2,
                 shard_tokens=SHARD_TOKENS)
    return root / "out", docs


def test_shards_hold_every_document_then_end_of_text_in_fixed_sizes(tokenized):
    out, docs = tokenized
    manifest = json.loads((out / "manifest.json").read_text())
    expected = reference(docs)
    assert shard_tokens(out) == expected
    sizes = [s["tokens"] for s in manifest["shards"]]
    assert all(n == SHARD_TOKENS for n in sizes[:-1]) and 0 < sizes[-1] <= SHARD_TOKENS, sizes
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == 50257
    assert manifest["n_tokens"] == len(expected) and manifest["documents"] == len(docs)
    for shard in manifest["shards"]:
        digest = hashlib.sha256((out / shard["file"]).read_bytes()).hexdigest()
        assert digest == shard["sha256"], shard["file"]
    assert not (out / ".parts").exists()


def test_an_interrupted_run_resumes_with_the_missing_pieces_only(tmp_path, monkeypatch,
                                                                 capsys):
    docs = corpus()
    src = write_jsonl(tmp_path / "docs.jsonl", docs)
    monkeypatch.setattr(piece_plan, "PIECE_BYTES", 2000)  # several pieces

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(tok, "write_shards", interrupted)
        with pytest.raises(KeyboardInterrupt):
            tok.tokenize(str(src), tmp_path / "out", jobs=1, shard_tokens=SHARD_TOKENS)
    notes = sorted((tmp_path / "out" / ".parts").glob("0*.json"))
    assert len(notes) > 3 and not (tmp_path / "out" / "manifest.json").exists()
    notes[1].unlink()  # as if killed while that piece was being written
    capsys.readouterr()
    tok.tokenize(str(src), tmp_path / "out", jobs=1, shard_tokens=SHARD_TOKENS)
    assert f"resuming: {len(notes) - 1} of {len(notes)} pieces" in capsys.readouterr().err
    assert shard_tokens(tmp_path / "out") == reference(docs)
    with pytest.raises(ConfigError, match="already holds"):
        tok.tokenize(str(src), tmp_path / "out")


def test_cli_bad_source_is_one_line_and_exit_2(tmp_path, capsys):
    assert tok.main([str(tmp_path / "missing.jsonl"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    assert not (tmp_path / "out").exists()


def test_windows_across_shard_boundaries_match_the_flat_stream(tokenized):
    out, docs = tokenized
    flat = np.asarray(reference(docs), dtype=np.uint16)
    stream = ShardStream(out, read_manifest(out))
    assert stream._maps == {}  # opening maps nothing: start-up reads only the manifest
    meta = {"eot_id": 50256, "pad_id": None}
    for seq_len in (7, 999, 1000, 2500):
        sharded = PackedTokens(stream, meta, seq_len, (123, len(flat)))
        plain = PackedTokens(flat, meta, seq_len, (123, len(flat)))
        assert len(sharded) == len(plain)
        for i in range(len(plain)):
            for key in ("input", "labels"):
                assert sharded[i][key].equal(plain[i][key]), (seq_len, i, key)


def test_validation_cut_falls_after_an_end_of_text():
    eot = 9
    tokens = np.array([1, 2, eot, 3, 4, 5, eot, 6, eot, 7, 7, 7, eot], dtype=np.uint16)
    cut = held_out_cut(tokens, eot, 0.4)  # target index 7: the next eot is at 8
    assert cut == 9 and tokens[cut - 1] == eot
    one_document = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], dtype=np.uint16)
    assert held_out_cut(one_document, 99, 0.2) == 8  # no boundary: cut at the fraction
