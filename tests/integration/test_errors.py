"""Bad input: one readable line, non-zero exit on every rank, no hang, no traceback.

The time to fail is measured by benchmarks/fail_fast.py; the timeout here only catches hangs."""

from __future__ import annotations

import pytest

from tests.harness import run_ranks

SLOW = pytest.mark.slow  # the same path as a default case; each refusal's line is a unit test
BAD_CONFIGS = [
    (4, ["--model", "debug", "--tp", "3"], "--n-heads 4 is not divisible by --tp 3"),
    pytest.param(4, ["--model", "debug", "--dp-replicate", "3"], "divisible by dp_replicate 3",
                 marks=SLOW),
    pytest.param(2, ["--model", "debug", "--dp-shard", "4"], "does not equal world size 2",
                 marks=SLOW),
    pytest.param(2, ["--model", "nope"], "unknown model preset", marks=SLOW),
    (2, ["--model", "debug", "--dataset", "random", "--batch-size", "5000", "--max-steps", "1"],
     "zero full batches"),  # a fact of the data, learned after start-up
]


@pytest.mark.multirank
@pytest.mark.parametrize(("world", "flags", "message"), BAD_CONFIGS)
def test_bad_configuration_fails_fast_on_every_rank(world, flags, message):
    job = run_ranks(world, ["-m", "loom", "train", *flags], timeout=300)
    assert all(r.returncode == 2 for r in job.ranks), job.describe()
    errors = [line for r in job.ranks for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0], job.describe()
    assert not any("Traceback" in r.stderr for r in job.ranks)


def test_empty_text_file_is_one_line_and_writes_nothing(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    job = run_ranks(1, ["-m", "loom", "train", "--model", "debug", "--dataset",
                        str(tmp_path / "empty.txt"), "--fp32", "--outdir", str(tmp_path / "run")],
                    timeout=300, env={"LOOM_CACHE_DIR": str(tmp_path / "cache")})
    (rank,) = job.ranks
    assert rank.returncode == 2, job.describe()
    assert rank.stderr.strip().splitlines() == [
        f"error: --dataset {tmp_path / 'empty.txt'}: column text holds no text"]
    assert not (tmp_path / "run").exists()


@pytest.mark.multirank
def test_model_too_large_for_memory_is_refused_before_allocation(tmp_path):
    job = run_ranks(2, ["-m", "loom", "train", "--model", "debug", "--dataset", "random",
                        "--vocab-size", "16000000", "--fp32", "--outdir", str(tmp_path / "run")],
                    timeout=300)
    assert all(r.returncode == 2 for r in job.ranks), job.describe()
    errors = [line for r in job.ranks for line in r.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "need ~" in errors[0] and "lower --vocab-size" in errors[0], \
        job.describe()
    assert not (tmp_path / "run").exists()


DIVERGING = ["-m", "loom", "train", "--model", "debug", "--dataset", "random", "--vocab-size",
             "512", "--seq-len", "64", "--fp32", "--lr", "1e30"]
"""lr 1e30: AdamW's first step moves every weight by ~1e30, so step 2 overflows."""


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-steps", "4"], "non-finite loss or gradient at step 2"),
    (["--max-steps", "10", "--skip-nonfinite", "--max-skipped-steps", "2"],
     "2 steps in a row (up to step 3) had a non-finite loss or gradient"),
], ids=["stop", "skip-then-stop"])
def test_diverged_run_exits_3_with_one_line(tmp_path, flags, message):
    job = run_ranks(1, [*DIVERGING, *flags, "--outdir", str(tmp_path / "run")], timeout=300)
    (rank,) = job.ranks
    errors = [line for line in rank.stderr.splitlines() if line.startswith("error")]
    assert rank.returncode == 3 and len(errors) == 1 and message in errors[0], job.describe()
    assert "Traceback" not in rank.stderr
