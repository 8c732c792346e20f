"""Validation end to end on `loom tokenize` shards: the held-out loss of a 2-rank dp run
equals the 1-rank one (same global batch), it is on every rank's metrics file, and
`loom eval` on the final checkpoint reproduces it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from loom.commands.tokenize import tokenize
from tests.compare import column
from tests.harness import run_ranks

RTOL = 1e-5
"""fp32; the dp run reduces gradients in another order (the parity tests' tolerance)."""


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("val")
    rng = random.Random(1)
    words = ["river", "stone", "light", "the", "of", "a", "green", "house", "sea", "and"]
    (root / "docs.jsonl").write_text("".join(
        json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(10, 80)))}) + "\n"
        for _ in range(400)))
    tokenize(str(root / "docs.jsonl"), root / "shards", jobs=1, shard_tokens=4096)
    return root / "shards"


def train_flags(shards: Path, outdir: Path, batch: int) -> list[str]:
    return ["-m", "loom", "train", "--model", "debug", "--fp32", "--dataset", str(shards),
            "--seq-len", "32", "--batch-size", str(batch), "--max-steps", "2", "--seed", "3",
            "--val-fraction", "0.2", "--eval-every", "1", "--eval-steps", "3",
            "--checkpoint-interval", "2", "--outdir", str(outdir)]


def assert_close(got: list[float], want: list[float], what: str) -> None:
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    assert len(got) == len(want) and worst <= RTOL, f"{what}: {got} vs {want}, rel {worst:.2e}"


@pytest.mark.multirank
def test_val_loss_is_the_same_on_1_and_2_dp_ranks_and_loom_eval_reproduces_it(tmp_path,
                                                                               shards):
    env = {"LOOM_CACHE_DIR": str(tmp_path / "cache")}
    one = run_ranks(1, train_flags(shards, tmp_path / "one", batch=2), timeout=240, env=env)
    assert one.ok, one.describe()
    two = run_ranks(2, train_flags(shards, tmp_path / "two", batch=1), timeout=240, env=env)
    assert two.ok, two.describe()
    reference = list(column(tmp_path / "one", "val/loss").values())
    assert len(reference) == 2 and all(0 < x < 12 for x in reference), reference
    for rank in (0, 1):
        assert_close(list(column(tmp_path / "two", "val/loss", rank).values()), reference,
                     f"2-rank val/loss, rank {rank}")
    assert "val " in one.ranks[0].stdout  # the console line shows it

    ckpt = tmp_path / "one" / "checkpoints" / "step-2"
    flags = ["--dataset", str(shards), "--val-fraction", "0.2", "--eval-steps", "3",
             "--seq-len", "32", "--batch-size", "1", "--fp32"]
    job = run_ranks(2, ["-m", "loom", "eval", str(ckpt), *flags], timeout=240, env=env)
    assert job.ok, job.describe()
    result = json.loads((tmp_path / "one" / "eval-step-2" / "eval.json").read_text())
    assert_close([result["val/loss"]], reference[-1:], "loom eval of the final checkpoint")
