"""Several validation sets end to end: two named sets are evaluated at the same steps,
logged under their own keys on every row they ran, summarised and drawn as their own
curves; `loom eval` of the final checkpoint scores every token of a 10,000-token file
(2 dp ranks, a batch that does not divide its windows) unless --eval-steps limits it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loom.commands.tokenize import tokenize
from loom.data.shards import read_manifest
from loom.observability.plots import plot_series
from tests.compare import rows
from tests.corpora import WORDS, documents, write_jsonl
from tests.harness import run_ranks

SET_WORDS = {"train": WORDS, "a": ["river", "stone", "the", "of", "sea"],
             "b": ["quantum", "lattice", "ferment", "zebra", "oblique", "the"],
             "ten_k": ["light", "house", "green", "and", "a"]}


def corpus(root: Path, name: str, docs: int) -> Path:
    write_jsonl(root / f"{name}.jsonl", documents(SET_WORDS[name], docs, name))
    tokenize(str(root / f"{name}.jsonl"), root / name, jobs=1, shard_tokens=1 << 20)
    return root / name


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("valsets")
    return {"train": corpus(root, "train", 300), "a": corpus(root, "a", 40),
            "b": corpus(root, "b", 40), "ten_k": corpus(root, "ten_k", 240)}


def manifest_tokens(folder: Path) -> int:
    return read_manifest(folder)["n_tokens"]


@pytest.mark.multirank
def test_two_named_sets_are_logged_and_plotted_and_loom_eval_scores_a_whole_file(tmp_path,
                                                                                  data):
    env = {"LOOM_CACHE_DIR": str(tmp_path / "cache")}
    train = ["--model", "debug", "--fp32", "--seq-len", "32", "--batch-size", "2"]
    job = run_ranks(1, ["-m", "loom", "train", *train, "--dataset", str(data["train"]),
                        "--val-dataset", f"a={data['a']}", "--val-dataset", f"b={data['b']}",
                        "--eval-every", "2", "--eval-steps", "0", "--max-steps", "4",
                        "--checkpoint-interval", "4", "--outdir", str(tmp_path / "run")],
                    timeout=600, env=env)
    assert job.ok, job.describe()
    table = rows(tmp_path / "run")
    for name in ("a", "b"):
        evaluated = [r["train/iter"] for r in table if f"val/{name}/loss" in r]
        assert evaluated == [2, 4], (name, evaluated)
        scored = {r[f"val/{name}/tokens"] for r in table if f"val/{name}/tokens" in r}
        assert scored == {manifest_tokens(data[name]) - 1}, "the whole set, every evaluation"
    assert not any("val/loss" in r for r in table), "no default set was given"
    last = table[-1]
    assert last["val/a/loss"] != last["val/b/loss"], "two sets, two losses"
    assert any("val/a " in line and "val/b " in line for line in job.ranks[0].stdout.splitlines())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["metrics"]
    assert summary["val/b/loss"]["last"] == last["val/b/loss"]
    curves = plot_series(table)["loss.png"]
    assert set(curves) == {"train/loss", "val/a/loss", "val/b/loss"}
    assert [p[1] for p in curves["val/a/loss"]] == [r["val/a/loss"] for r in table
                                                    if "val/a/loss" in r]
    assert (tmp_path / "run" / "plots" / "loss.png").stat().st_size > 0

    ckpt = tmp_path / "run" / "checkpoints" / "step-4"
    n_tokens = manifest_tokens(data["ten_k"])
    assert 10_000 <= n_tokens < 12_000, n_tokens
    flags = ["--dataset", str(data["ten_k"]), "--seq-len", "32", "--batch-size", "3", "--fp32"]
    whole = run_ranks(2, ["-m", "loom", "eval", str(ckpt), *flags], timeout=600, env=env)
    assert whole.ok, whole.describe()
    result = json.loads((tmp_path / "run" / "eval-step-4" / "eval.json").read_text())
    assert result["val/tokens"] == n_tokens - 1, "every token after the file's first"
    assert f"scored {n_tokens - 1:,} tokens (every window)" in whole.ranks[0].stdout
    limited = run_ranks(1, ["-m", "loom", "eval", str(ckpt), *flags, "--eval-steps", "2"],
                        timeout=600, env=env)
    assert limited.ok, limited.describe()
    assert "scored 192 tokens (the first 2 of" in limited.ranks[0].stdout  # 2 x 3 x 32
