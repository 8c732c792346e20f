"""Compiled MoE parity: `--compile --ep 2` on 2 ranks, routed experts and their all-to-all
inside the compiled blocks, trains like one eager process (fp32, 5 steps, global batch 4):
losses and pre-clip gradient norms within the MoE parity tests' measured tolerances
(test_moe_parity.py: RTOL, FIRST_GRAD_NORM_RTOL, GRAD_NORM_RTOL), routing counts exactly, under
FSDP2 (MoE blocks break their graph around the experts' FSDP2 hooks) and SimpleFSDP (the
whole model one graph).

The FSDP2 run replays the reference's routing (tests/routing.py; its hook runs eagerly, one
more graph break at each router). The SimpleFSDP run cannot: a hook that swaps the picks
from Python has no place in a full graph, so it routes on its own and the exact routing
counts check that no near tie flipped (see test_moe_parity.py on ties).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import run_ranks
from tests.parity.test_moe_parity import (
    COMMON,
    GLOBAL_BATCH,
    assert_flips_are_ties,
    assert_same_steps,
)
from tests.routing import load_flips

COMPILE = ["--compile", "--compile-backend", "aot_eager", "--ep", "2",
           "--batch-size", str(GLOBAL_BATCH // 2)]
CASES = {  # name: (flags, routing replayed)
    "ep2_fsdp2_compiled": (["--data-parallel", "fsdp2", *COMPILE], True),
    "ep2_simple_fsdp_compiled": (["--data-parallel", "simple-fsdp", *COMPILE], False),
}
EAGER_LINE = "run eagerly"
BREAK_LINE = "routed experts and their all-to-all are compiled"


def train(world: int, runs: list[dict]) -> list[str]:
    """Every rank trains `runs` in turn; rank 0's stdout (loom's log)."""
    job = run_ranks(world, ["tests/workers/parity_worker.py", json.dumps(runs)], timeout=1200)
    assert job.ok, job.describe()
    return job.ranks[0].stdout


def train_reference(root: Path) -> Path:
    """The eager single-process run every case is compared with, recording its routing."""
    train(1, [{"argv": [*COMMON, "--batch-size", str(GLOBAL_BATCH), "--outdir",
                        str(root / "single")], "routing": "record"}])
    return root / "single"


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    return train_reference(tmp_path_factory.mktemp("compiled_moe"))


def run_case(single: Path, root: Path, case: str) -> tuple[Path, str]:
    flags, replay = CASES[case]
    run = {"argv": [*COMMON, *flags, "--outdir", str(root / case)],
           "routing": str(single) if replay else None}
    return root / case, train(2, [run])


@pytest.mark.multirank
def test_compiled_ep2_under_fsdp2_matches_one_process(single: Path, tmp_path: Path) -> None:
    candidate, log = run_case(single, tmp_path, "ep2_fsdp2_compiled")
    assert EAGER_LINE not in log and log.count(BREAK_LINE) == 1, log[-3000:]
    assert load_flips(candidate), "the routing was not replayed"
    assert_flips_are_ties(candidate)
    assert_same_steps(candidate, single)


@pytest.mark.multirank
@pytest.mark.slow  # ~80 s of whole-model compile; the dense case runs by default
def test_compiled_ep2_under_simple_fsdp_matches_one_process(single: Path,
                                                            tmp_path: Path) -> None:
    candidate, log = run_case(single, tmp_path, "ep2_simple_fsdp_compiled")
    assert EAGER_LINE not in log and BREAK_LINE not in log, log[-3000:]
    assert "compiled the whole model" in log, log[-3000:]
    assert_same_steps(candidate, single)
