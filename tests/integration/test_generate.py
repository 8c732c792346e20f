"""`loom generate`: a checkpoint holding the initial weights samples exactly what the same
function samples from the freshly built model; after a short run on the embedded corpus
(slow) the model samples common English words while the untrained one samples noise, judged
by the share of generated words among the corpus's most frequent words."""

from __future__ import annotations

import collections
import gzip
import re

import pytest
import torch

from loom.commands.generate import sample
from loom.config import parse_args
from loom.data.text import EMBEDDED_CORPUS
from loom.data.tokenizers import load_shipped_tokenizer
from loom.models.llama.model import Transformer
from loom.models.resolve import model_args
from loom.parallel.init import init_weights
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
    args = model_args(parse_args([*TRAIN, "--vocab-size", "50257"]))
    with torch.device("meta"):
        model = Transformer(args)
    init_weights(model, SEED, torch.device("cpu"))
    tokenizer = load_shipped_tokenizer()
    ids = sample(model.eval(), tokenizer.encode(["It was"])[0], 80, context=args.max_seq_len,
                 temperature=0.8, top_k=40, seed=0)
    return tokenizer.decode(ids)


def generated(tmp_path, steps: int, *flags: str) -> str:
    """`loom generate` on the checkpoint of a `steps`-step run: its standard output."""
    env = {"LOOM_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    job = run_ranks(1, ["-m", "loom", "train", *TRAIN, *flags, "--max-steps", str(steps),
                        "--checkpoint-interval", str(steps), "--outdir", str(tmp_path / "run")],
                    timeout=600, env=env)
    assert job.ok, job.describe()
    step = tmp_path / "run" / "checkpoints" / f"step-{steps}"
    out = run_ranks(1, ["-m", "loom", "generate", str(step), *SAMPLE], timeout=120, env=env)
    assert out.ok, out.describe()
    return out.ranks[0].stdout


def test_a_checkpoint_of_the_initial_weights_samples_what_the_built_model_samples(tmp_path):
    """An lr far below fp32 resolution leaves the initial weights bit-identical after one
    step, so checkpoint, loading, tokenizer and sampling must reproduce the sample exactly."""
    out = generated(tmp_path, 1, "--lr", "1e-30")
    assert out.removesuffix("\n") == untrained_sample(), out


def test_a_tokenizer_larger_than_the_vocab_is_one_line(tmp_path):
    job = run_ranks(1, ["-m", "loom", "train", "--model", "debug", "--fp32", "--dataset",
                        "random", "--vocab-size", "64", "--seq-len", "16", "--max-steps", "1",
                        "--checkpoint-interval", "1", "--outdir", str(tmp_path / "run")],
                    timeout=600)
    assert job.ok, job.describe()
    step = tmp_path / "run" / "checkpoints" / "step-1"
    out = run_ranks(1, ["-m", "loom", "generate", str(step), "--prompt", "It was"],
                    timeout=120)
    lines = out.ranks[0].stderr.strip().splitlines()
    assert out.ranks[0].returncode == 2 and len(lines) == 1, out.describe()
    assert "vocabulary of 64 tokens" in lines[0] and "--tokenizer-name" in lines[0], lines


@pytest.mark.slow
def test_trained_model_writes_common_words_and_an_untrained_one_noise(tmp_path):
    common = common_words()
    trained, untrained = generated(tmp_path, 30), untrained_sample()
    share, n_words = common_share(trained, common)
    noise, n_noise = common_share(untrained, common)
    assert n_words >= 10 and share >= 0.6, f"trained: {share:.2f} of {n_words}: {trained!r}"
    assert n_noise >= 10 and noise <= 0.3, f"untrained: {noise:.2f} of {n_noise}: {untrained!r}"
