"""--streaming on 2 dp ranks: a run resumed from a mid-run checkpoint takes the same next
steps (losses within 1e-6, fp32) as the uninterrupted run."""

from __future__ import annotations

import json
import random

import pytest

from tests.compare import column
from tests.harness import run_ranks

ATOL = 1e-6


def streaming_flags(tmp_path, max_steps: int) -> list[str]:
    rng = random.Random(4)
    words = ["wind", "over", "the", "hill", "and", "a", "boat", "of", "grey", "water"]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(
        5, 60)))}) + "\n" for _ in range(300)))
    return ["-m", "loom", "train", "--model", "debug", "--fp32", "--dataset", str(src),
            "--streaming", "--seq-len", "32", "--batch-size", "2", "--seed", "5",
            "--max-steps", str(max_steps)]


def resumed_losses_match(tmp_path, ranks: int, flags: list[str], steps: tuple[int, ...]
                         ) -> dict:
    """Train with a checkpoint at step 2, resume from it, compare the later steps' losses;
    returns the saved stream positions."""
    env = {"LOOM_CACHE_DIR": str(tmp_path / "cache")}
    full = run_ranks(ranks, [*flags, "--checkpoint-interval", "2", "--outdir",
                             str(tmp_path / "full")], timeout=300, env=env)
    assert full.ok, full.describe()
    ckpt = tmp_path / "full" / "checkpoints" / "step-2"
    saved = json.loads((ckpt / "loop.json").read_text())["stream_positions"]
    resumed = run_ranks(ranks, [*flags, "--resume", str(ckpt), "--outdir",
                                str(tmp_path / "res")], timeout=300, env=env)
    assert resumed.ok, resumed.describe()
    want, got = column(tmp_path / "full"), column(tmp_path / "res")
    diffs = {step: abs(got[step] - want[step]) for step in steps}
    assert max(diffs.values()) <= ATOL, f"resumed vs uninterrupted loss diffs {diffs}"
    return saved


def test_one_process_streaming_run_checkpoints_and_resumes(tmp_path):
    """The default selection's streaming checkpoint: one process saves its position at
    step 2 and the resumed run's step 3 is the uninterrupted one's."""
    saved = resumed_losses_match(tmp_path, 1, streaming_flags(tmp_path, 3), (3,))
    assert set(saved) == {"0"}, saved


@pytest.mark.multirank
@pytest.mark.slow
def test_streaming_resume_continues_exactly(tmp_path):
    """Slow (two 2-rank runs); by default the one-process case above and
    tests/unit/data/test_streaming.py (a saved position continues with the next window)."""
    saved = resumed_losses_match(tmp_path, 2, streaming_flags(tmp_path, 4), (3, 4))
    assert set(saved) == {"0", "1"} and saved["0"] != saved["1"], saved
