"""FSDP2's point-to-point all-gather and reduce-scatter on gloo give gloo's own results, on
the world group, on groups whose ranks are not the global ones, and on an odd-sized group.
The training parity tests (tests/parity/test_parity.py) run them inside FSDP2."""

from __future__ import annotations

import json

from tests.harness import run_ranks


def test_pairwise_collectives_match_gloo() -> None:
    job = run_ranks(4, ["tests/workers/gloo_comm_worker.py"], timeout=300)
    assert job.ok, job.describe()
    for result in job.ranks:
        groups = json.loads(result.stdout.strip().splitlines()[-1])
        assert set(groups) == ({"world", "pairs"} if result.rank == 0
                               else {"world", "pairs", "three"})
        for name, worst in groups.items():
            assert worst["all_gather"] == 0.0 and worst["all_gather_async"] == 0.0, (name, worst)
            assert max(worst.values()) < 1e-5, (name, worst)
