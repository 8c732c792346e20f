"""Bad input: one readable line, non-zero exit on every rank, no hang, no traceback."""

from __future__ import annotations

import pytest

from tests.harness import run_ranks

BAD_CONFIGS = [
    (4, ["--model", "debug", "--tp", "3"], "--n-heads 4 is not divisible by --tp 3"),
    (4, ["--model", "debug", "--dp-replicate", "3"], "divisible by dp_replicate 3"),
    (2, ["--model", "debug", "--dp-shard", "4"], "does not equal world size 2"),
    (2, ["--model", "nope"], "unknown model preset"),
    (2, ["--model", "debug", "--dataset", "random", "--batch-size", "5000", "--max-steps", "1"],
     "zero full batches"),
]


@pytest.mark.multirank
@pytest.mark.parametrize(("world", "flags", "message"), BAD_CONFIGS)
def test_bad_configuration_fails_fast_on_every_rank(world, flags, message):
    job = run_ranks(world, ["-m", "loom", "train", *flags], timeout=60)
    assert job.elapsed < 30, job.describe()
    assert all(r.returncode == 2 for r in job.ranks), job.describe()
    errors = [line for r in job.ranks for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0], job.describe()
    assert not any("Traceback" in r.stderr for r in job.ranks)
