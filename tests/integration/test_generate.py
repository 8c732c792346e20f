"""`loom generate`: after a short run on the embedded corpus the model samples common English
words; an untrained one (same path, learning rate 0) samples noise. Judged by word
frequency: the share of generated words among the corpus's most frequent words."""

from __future__ import annotations

import collections
import gzip
import re
from pathlib import Path

import pytest

from loom.data.text import EMBEDDED_CORPUS
from tests.harness import run_ranks

WORD = re.compile(r"[a-z]+")
COMMON = 200
"""Size of the common-word list: the corpus's most frequent words."""
SAMPLE = ["--prompt", "It was", "--max-new-tokens", "80", "--temperature", "0.8",
          "--top-k", "40", "--seed", "0"]


def common_words() -> set[str]:
    counts: collections.Counter[str] = collections.Counter()
    for path in EMBEDDED_CORPUS.iterdir():
        counts.update(WORD.findall(gzip.decompress(path.read_bytes()).decode().lower()))
    return {w for w, _ in counts.most_common(COMMON)}


def common_share(text: str, common: set[str]) -> tuple[float, int]:
    words = WORD.findall(text.lower().removeprefix("it was"))
    return (sum(w in common for w in words) / len(words) if words else 0.0), len(words)


def train_and_generate(outdir: Path, cache: Path, extra: list[str]) -> str:
    flags = ["--model", "debug", "--fp32", "--seq-len", "64", "--batch-size", "4",
             "--seed", "2", "--outdir", str(outdir), *extra]
    env = {"LOOM_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    job = run_ranks(1, ["-m", "loom", "train", *flags], timeout=600, env=env)
    assert job.ok, job.describe()
    step = sorted((outdir / "checkpoints").iterdir())[-1]
    out = run_ranks(1, ["-m", "loom", "generate", str(step), *SAMPLE], timeout=120, env=env)
    assert out.ok, out.describe()
    return out.ranks[0].stdout


@pytest.mark.multirank
def test_trained_model_writes_common_words_and_an_untrained_one_noise(tmp_path):
    common = common_words()
    cache = tmp_path / "cache"
    trained = train_and_generate(tmp_path / "trained", cache,
                                 ["--max-steps", "30", "--checkpoint-interval", "30"])
    untrained = train_and_generate(tmp_path / "untrained", cache,
                                   ["--max-steps", "1", "--lr", "0", "--checkpoint-interval",
                                    "1"])
    share, n_words = common_share(trained, common)
    noise, n_noise = common_share(untrained, common)
    assert n_words >= 10 and share >= 0.6, f"trained: {share:.2f} of {n_words}: {trained!r}"
    assert n_noise >= 10 and noise <= 0.3, f"untrained: {noise:.2f} of {n_noise}: {untrained!r}"
