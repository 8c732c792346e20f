"""`loom tokenize` in bounded memory: block edges change no token, every input format gives
the same tokens, bad input is one line and exit 2, a killed worker ends the command with
nothing finalized, and a worker's peak memory does not grow with the file."""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from loom.commands import tokenize as tok
from loom.data import pieces as piece_plan
from loom.data.blocks import fragments
from loom.data.shards import ShardStream, read_manifest
from loom.data.tokenizers import load_shipped_tokenizer

WORDS = ["the", "of", "and", "a", "to", "in", "is", "was", "naïve", "日本語", "it's", "42",
         "x=1;", "  ", "\n", "\n\n", "\t", " \n", ".", "--", "'ll", "über", "\r\n", "🙂"]


def text_of(n_words: int, seed: int = 0) -> str:
    """Words, blanks and line breaks of every kind the GPT-2 regex treats specially."""
    rng = random.Random(seed)
    return " ".join(rng.choices(WORDS, k=n_words))


def reference(docs: list[str]) -> list[int]:
    tokenizer = load_shipped_tokenizer()
    return [t for ids in tokenizer.encode(docs) for t in (*ids, tokenizer.eot_id)]


def shard_tokens(out: Path) -> list[int]:
    return ShardStream(out, read_manifest(out))[:].astype(np.int64).tolist()


def test_fragments_at_any_block_size_encode_as_the_whole_text():
    tokenizer = load_shipped_tokenizer()
    text = text_of(6000)
    whole = tokenizer.encode([text])[0]
    for block in (8, 64, 1000):
        chunks = [text[i:i + block] for i in range(0, len(text), block)]
        pieces = list(fragments(chunks, block, tokenizer.encode))
        assert len(pieces) > len(text) // (8 * block), block  # it did cut
        assert "".join(pieces) == text
        assert [t for ids in tokenizer.encode(pieces) for t in ids] == whole, block


def test_tiny_blocks_and_pieces_give_the_whole_file_tokens(tmp_path, monkeypatch):
    """A .txt file cut into byte-range pieces and tiny blocks, and a jsonl document far
    longer than a block, tokenize as if each document were encoded whole."""
    monkeypatch.setattr(piece_plan, "PIECE_BYTES", 3000)  # several pieces per file
    text = text_of(4000)
    (tmp_path / "one.txt").write_text(text, encoding="utf-8", newline="")
    tok.tokenize(str(tmp_path / "one.txt"), tmp_path / "out-txt", jobs=2, block_chars=64)
    assert shard_tokens(tmp_path / "out-txt") == reference([text])
    manifest = read_manifest(tmp_path / "out-txt")
    assert manifest["documents"] == 1

    docs = ["short one", text_of(3000, seed=1), "", "another short"]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok.tokenize(str(path), tmp_path / "out-jsonl", jobs=1, block_chars=64)
    assert shard_tokens(tmp_path / "out-jsonl") == reference([d for d in docs if d])


def write_formats(root: Path, docs: list[str]) -> dict[str, Path]:
    lines = "".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs))
    files = {"jsonl": root / "a.jsonl", "gz": root / "a.jsonl.gz", "zst": root / "a.jsonl.zst",
             "parquet": root / "a.parquet"}
    files["jsonl"].write_text(lines)
    files["gz"].write_bytes(gzip.compress(lines.encode()))
    half = len(lines) // 2  # two zstd frames: a stream reads across them
    files["zst"].write_bytes(zstandard.ZstdCompressor().compress(lines[:half].encode())
                             + zstandard.ZstdCompressor().compress(lines[half:].encode()))
    pq.write_table(pa.table({"body": docs, "id": list(range(len(docs)))}, ),
                   files["parquet"], row_group_size=7)
    return files


def test_jsonl_parquet_gzip_and_zstd_inputs_give_the_same_tokens(tmp_path):
    docs = [text_of(random.Random(i).randint(1, 80), seed=i) for i in range(40)]
    expected = reference(docs)
    for kind, path in write_formats(tmp_path, docs).items():
        manifest = tok.tokenize(str(path), tmp_path / f"out-{kind}", jobs=1, column="body")
        assert shard_tokens(tmp_path / f"out-{kind}") == expected, kind
        assert manifest["documents"] == len(docs), kind
    text = text_of(500)
    (tmp_path / "t.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    tok.tokenize(str(tmp_path / "t.txt.zst"), tmp_path / "out-txt-zst", block_chars=128)
    assert shard_tokens(tmp_path / "out-txt-zst") == reference([text])


@pytest.mark.parametrize("bad_line, message", [
    ("{not json", "line 12 is not JSON"),
    ('{"body": "x"}', "line 12 has no 'text' field (fields: body; --text-column picks another)"),
    ('{"text": 5}', "line 12 field 'text' holds a JSON int, not a string"),
    ('["text"]', "line 12 is a JSON list, not an object"),
])
def test_a_bad_jsonl_line_is_one_line_naming_file_and_line_and_exit_2(
        tmp_path, monkeypatch, capsys, bad_line, message):
    monkeypatch.setattr(piece_plan, "PIECE_BYTES", 100)  # the bad line is in a later piece
    lines = [json.dumps({"text": f"document number {i}"}) for i in range(20)]
    lines[11] = bad_line
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert tok.main([str(path), str(tmp_path / "out"), "-j", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: {path}: {message}", err
    assert sum("error" in line for line in err) == 1 and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_missing_or_non_text_parquet_column_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"body": ["a", "b"], "n": [1, 2]}), path)
    assert tok.main([str(path), str(tmp_path / "o1"), "-j", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: {path}: no column 'text' (columns: body, n; --text-column " \
                      "picks another)", err
    assert tok.main([str(path), str(tmp_path / "o2"), "-j", "1", "--text-column", "n"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        f"error: {path}: column 'n' holds int64, not strings"


@pytest.mark.parametrize("name, data, message", [
    ("a.jsonl.gz", gzip.compress(b'{"text": "a b c"}\n' * 500)[:-40],
     "corrupt or truncated compressed data"),
    ("a.txt.zst", zstandard.ZstdCompressor().compress(text_of(2000).encode())[:-30],
     "corrupt or truncated zstd data"),
    ("a.txt", b"fine text then \xff\xfe bad bytes", "not UTF-8 text near byte 15"),
])
def test_corrupt_compressed_or_non_utf8_files_are_one_line_and_exit_2(tmp_path, capsys,
                                                                       name, data, message):
    (tmp_path / name).write_bytes(data)
    assert tok.main([str(tmp_path / name), str(tmp_path / "out"), "-j", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {tmp_path / name}") and message in err[-1], err
    assert sum("error" in line for line in err) == 1


def _children(pid: int) -> list[int]:
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(k) for k in kids]


def _worker_of(proc: subprocess.Popen) -> int:
    """The pid of `proc`'s tokenizer worker, as soon as it exists."""
    while proc.poll() is None:
        workers = [p for p in _children(proc.pid)
                   if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        if workers:
            return workers[0]
        time.sleep(0.02)
    raise AssertionError(f"loom tokenize ended first: {proc.communicate()}")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_a_killed_worker_ends_the_command_with_one_line_and_nothing_finalized(tmp_path):
    """The worker is killed as soon as it exists: its one piece (12 MB, seconds of
    tokenizing after seconds of start-up) is then unfinished. A FIFO source, which would
    hold it mid-read, is refused before any worker starts."""
    corpus, out = tmp_path / "corpus.txt", tmp_path / "out"
    corpus.write_text(text_of(2_000_000))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "loom", "tokenize", str(corpus), str(out),
                             "-j", "1"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        os.kill(_worker_of(proc), signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=120)  # a hang fails here
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = stderr.strip().splitlines()
    assert proc.returncode == 1, stderr
    assert lines[-1].startswith(f"error: loom tokenize: the worker tokenizing {corpus} died: "
                                "killed by SIGKILL"), stderr
    assert sum("error" in line for line in lines) == 1 and "Traceback" not in stderr
    assert stdout == ""
    assert not (out / "manifest.json").exists() and not list(out.glob("shard-*"))
    assert not list((out / ".parts").glob("0*"))  # no part looks finished


def _peak_rss(tmp_path: Path, name: str, text: str, block_chars: int) -> int:
    path = tmp_path / name
    path.write_text(text)
    manifest = tok.tokenize(str(path), tmp_path / f"out-{name}", jobs=1,
                            block_chars=block_chars)
    path.unlink()
    return manifest["speed"]["worker_peak_rss_mb"]


def test_worker_memory_does_not_grow_with_the_file(tmp_path):
    """One 8 MB document (whole, the tokenizer alone would hold ~1.6 GB) vs 0.5 MB."""
    small = _peak_rss(tmp_path, "small.txt", text_of(100_000), 2**16)
    large = _peak_rss(tmp_path, "large.txt", text_of(1_600_000, seed=1), 2**16)
    assert 0 < large <= 1.5 * small, (small, large)


def _jsonl_gz(path: Path, megabytes: int) -> None:
    """Documents of 50-500 words, written to a .jsonl.gz (one piece: one worker reads it
    all) in 1 MB pieces, so the test itself holds little."""
    rng, written = random.Random(0), 0
    with gzip.open(path, "wt", compresslevel=1) as f:
        while written < megabytes * 2**20:
            lines = "".join(json.dumps({"text": text_of(rng.randint(50, 500), rng.random())})
                            + "\n" for _ in range(300))
            f.write(lines)
            written += len(lines)


@pytest.mark.slow
def test_worker_memory_is_flat_from_1_to_64_mb_of_compressed_jsonl_at_the_default_block(
        tmp_path):
    """The default BLOCK_CHARS on one streamed .jsonl.gz piece: 64 MB vs 1 MB."""
    peaks = []
    for megabytes in (1, 64):
        _jsonl_gz(tmp_path / f"{megabytes}.jsonl.gz", megabytes)
        manifest = tok.tokenize(str(tmp_path / f"{megabytes}.jsonl.gz"),
                                tmp_path / f"out-{megabytes}", jobs=1)
        peaks.append(manifest["speed"]["worker_peak_rss_mb"])
    assert 0 < peaks[1] <= 1.5 * peaks[0], peaks
