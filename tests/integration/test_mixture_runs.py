"""A weighted mixture end to end: three sources of three kinds (a text file, a JSONL file,
a `loom tokenize` shard folder) at 0.5/0.3/0.2 give exactly those shares of the windows of
a 100-step run (summary.json, the checkpoint's record), and a run resumed from its step-50
checkpoint at another dp degree (same global batch) continues the same window sequence:
the same per-source counts at every checkpoint and the same losses step by step. (The
window ids themselves are compared across dp degrees in tests/unit/data/test_mixture.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loom.commands.tokenize import tokenize
from tests.compare import column
from tests.corpora import WORDS, documents, write_jsonl
from tests.harness import run_ranks

TINY = ["--model", "debug", "--dim", "64", "--n-layers", "2", "--n-heads", "4",
        "--n-kv-heads", "2", "--fp32", "--seq-len", "16", "--max-steps", "100",
        "--checkpoint-interval", "50", "--keep-checkpoints", "4"]
RTOL = 1e-4
"""fp32; the 2-rank run reduces gradients in another order."""


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("mix")
    (root / "web.txt").write_text("\n\n".join(documents(WORDS, 30, "web", (60, 60))))
    write_jsonl(root / "docs.jsonl", documents(WORDS[:5], 8, "docs", (50, 50)))
    write_jsonl(root / "code.jsonl", documents(WORDS[5:], 6, "code", (40, 40)))
    tokenize(str(root / "code.jsonl"), root / "shards", jobs=1)
    return f"{root / 'web.txt'}:0.5,{root / 'docs.jsonl'}:0.3,{root / 'shards'}:0.2"


def loop_mixture(run: Path, step: int) -> list[int]:
    loop = json.loads((run / "checkpoints" / f"step-{step}" / "loop.json").read_text())
    return [s["windows"] for s in loop["mixture"]["sources"]]


@pytest.mark.multirank
def test_three_sources_hold_their_shares_and_a_resume_at_dp2_continues_them(tmp_path,
                                                                             sources):
    env = {"LOOM_CACHE_DIR": str(tmp_path / "cache")}
    one = run_ranks(1, ["-m", "loom", "train", *TINY, "--dataset", sources, "--batch-size",
                        "2", "--outdir", str(tmp_path / "one")], timeout=900, env=env)
    assert one.ok, one.describe()
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())["data_sources"]
    assert [(s["windows"], s["share"], s["tokens"]) for s in summary.values()] == [
        (100, 0.5, 1600), (60, 0.3, 960), (40, 0.2, 640)]  # 200 windows of 16 tokens
    assert loop_mixture(tmp_path / "one", 50) == [50, 30, 20]
    assert loop_mixture(tmp_path / "one", 100) == [100, 60, 40]

    resumed = run_ranks(2, ["-m", "loom", "train", *TINY, "--dataset", sources,
                            "--batch-size", "1", "--outdir", str(tmp_path / "two"),
                            "--resume", str(tmp_path / "one" / "checkpoints" / "step-50")],
                        timeout=900, env=env)
    assert resumed.ok, resumed.describe()
    assert loop_mixture(tmp_path / "two", 100) == [100, 60, 40]
    want, got = column(tmp_path / "one", "train/loss"), column(tmp_path / "two", "train/loss")
    assert sorted(got) == list(range(51, 101))
    worst = max(abs(got[k] - want[k]) / abs(want[k]) for k in got)
    assert worst <= RTOL, f"the resumed run trains on other windows: rel {worst:.2e}"
    other = run_ranks(1, ["-m", "loom", "train", *TINY[:-4], "--max-steps", "1", "--dataset",
                          sources, "--mixture-exhausted", "drop", "--outdir",
                          str(tmp_path / "three"), "--resume",
                          str(tmp_path / "one" / "checkpoints" / "step-50")],
                      timeout=300, env=env)
    assert other.ranks[0].returncode == 2, other.describe()
    assert "differs from the checkpoint's" in other.ranks[0].stderr
