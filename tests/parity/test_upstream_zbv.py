"""Why loom makes each stage of a split-backward schedule (`--pp-schedule zero-bubble` /
`dualpipev`) one FSDP2 unit (`loom.parallel.fsdp.one_unit`) and refuses them with EP's
expert units (`loom.config.compose.REFUSALS`), reproduced with torch alone: on torch 2.13
(`loom.config.compose.TORCH_CHECKED`; the issue reports 2.15 the same) ScheduleZBVZeroBubble's
split backward (input gradients first, weight gradients deferred,
torch.distributed.pipelining's stage_backward_input / stage_backward_weight) gives wrong
weight gradients when a stage holds nested FSDP2 units (fully_shard on each block, then on
the stage), even on a one-rank dp mesh. The same schedule is exact on plain stages and on a
stage that is one FSDP2 unit, the controls that show the harness compares the right
gradients (loom's own stages: tests/parity/test_pipeline_parity.py::
test_v_schedules_match_one_process).

The nested case is asserted to still be wrong: the day torch fixes it this test fails, and
loom may go back to one unit per block under these schedules and lift the EP refusal."""

from __future__ import annotations

import json

import pytest
import torch

from loom.compat import v_schedules_send_to_own_rank
from tests.harness import run_ranks

SELF_SEND = "Pair is not connected"
"""gloo's error when a rank sends to itself (torch 2.11's V turn)."""

EXACT = 1e-5
"""fp32, 2 micro-batches against the whole batch: measured worst 1e-7."""
WRONG = 0.1
"""Measured on torch 2.13: worst relative weight-gradient error 1.0 (a gradient left zero)
on rank 0 and 2.9 on rank 1."""


@pytest.mark.multirank
def test_zbv_weight_gradients_are_wrong_with_nested_fsdp2_units() -> None:
    """Where `loom.compat.v_schedules_send_to_own_rank` says so (torch 2.11-2.12), the
    schedule does not run at all over gloo, not even on plain stages: asserted too, so the
    test fails the day that changes."""
    job = run_ranks(2, ["tests/workers/zbv_fsdp_worker.py", "plain", "fsdp2", "nested"],
                    timeout=300)
    if v_schedules_send_to_own_rank():
        assert not job.ok and any(SELF_SEND in r.stderr for r in job.ranks), (
            f"torch {torch.__version__} now runs ZBV over gloo ({job.describe()}): drop it "
            "from loom.compat.v_schedules_send_to_own_rank")
        return
    assert job.ok, job.describe()
    errors = [json.loads(r.stdout.strip().splitlines()[-1])["worst_relative"]
              for r in job.ranks]
    for rank in errors:
        assert rank["plain"] < EXACT and rank["fsdp2"] < EXACT, errors
    assert max(rank["nested"] for rank in errors) > WRONG, (
        f"torch's ZBV schedule now matches one process with nested FSDP2 stages ({errors}): "
        "lift the EP refusal of --pp-schedule zero-bubble / dualpipev (loom.config.compose) "
        "and let loom.parallel.fsdp.one_unit go")
