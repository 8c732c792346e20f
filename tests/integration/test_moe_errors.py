"""Bad expert-parallel combinations: one line, exit 2 on every rank, before any collective."""

from __future__ import annotations

import pytest

from tests.harness import run_ranks

BAD_MOE_CONFIGS = [
    (["--model", "moe-debug", "--ep", "4"], "--ep 4 must divide dp_shard x cp x --tp = 2"),
    (["--model", "moe-debug", "--n-experts", "6", "--ep", "4"],
     "--n-experts 6 is not divisible by --ep 4"),
    (["--model", "moe-debug", "--tp", "2", "--etp", "4"], "--etp 4 must be 1 or --tp 2"),
    (["--model", "debug", "--ep", "2"], "need a mixture-of-experts model"),
]


@pytest.mark.multirank
@pytest.mark.parametrize(("flags", "message"), BAD_MOE_CONFIGS)
def test_bad_moe_configuration_fails_fast_on_every_rank(flags, message):
    job = run_ranks(2, ["-m", "loom", "train", "--dataset", "random", *flags], timeout=300)
    assert all(r.returncode == 2 for r in job.ranks), job.describe()
    errors = [line for r in job.ranks for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0], job.describe()
    assert not any("Traceback" in r.stderr for r in job.ranks)
