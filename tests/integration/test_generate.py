"""`loom generate`: after a short run on the embedded corpus the model samples common English
words; the run's untrained starting model samples noise. Judged by word frequency: the
share of generated words among the corpus's most frequent words."""

from __future__ import annotations

import collections
import gzip
import re

import torch

from loom.config import parse_args
from loom.data.text import EMBEDDED_CORPUS
from loom.data.tokenizers import load_shipped_tokenizer
from loom.generate import sample
from loom.models.llama import Transformer
from loom.parallel.init import init_weights
from loom.train import model_args
from tests.harness import run_ranks

WORD = re.compile(r"[a-z]+")
COMMON = 200
"""Size of the common-word list: the corpus's most frequent words."""
SEED = 2
TRAIN = ["--model", "debug", "--fp32", "--seq-len", "64", "--batch-size", "4",
         "--seed", str(SEED)]
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


def untrained_sample() -> str:
    """The run's starting model (loom's init is a pure function of the seed and parameter
    names), sampled through the same function `loom generate` uses."""
    with torch.device("meta"):
        model = Transformer(model_args(parse_args([*TRAIN, "--vocab-size", "50257"])))
    init_weights(model, SEED, torch.device("cpu"))
    tokenizer = load_shipped_tokenizer()
    ids = sample(model.eval(), tokenizer.encode(["It was"])[0], 80, context=256,
                 temperature=0.8, top_k=40, seed=0)
    return tokenizer.decode(ids)


def test_trained_model_writes_common_words_and_an_untrained_one_noise(tmp_path):
    common = common_words()
    env = {"LOOM_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    job = run_ranks(1, ["-m", "loom", "train", *TRAIN, "--max-steps", "30",
                        "--checkpoint-interval", "30", "--outdir", str(tmp_path / "run")],
                    timeout=600, env=env)
    assert job.ok, job.describe()
    step = tmp_path / "run" / "checkpoints" / "step-30"
    out = run_ranks(1, ["-m", "loom", "generate", str(step), *SAMPLE], timeout=120, env=env)
    assert out.ok, out.describe()
    trained, untrained = out.ranks[0].stdout, untrained_sample()
    share, n_words = common_share(trained, common)
    noise, n_noise = common_share(untrained, common)
    assert n_words >= 10 and share >= 0.6, f"trained: {share:.2f} of {n_words}: {trained!r}"
    assert n_noise >= 10 and noise <= 0.3, f"untrained: {noise:.2f} of {n_noise}: {untrained!r}"
