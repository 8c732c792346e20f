"""The upstream reason `--compile` with `--ac` under TP (and SimpleFSDP) stays refused
(`loom.config.compose.REFUSALS`), reproduced: on torch 2.13 (`loom.config.compose.
TORCH_CHECKED`) AOT autograd's saved-state check fails at the first backward of a compiled,
checkpointed tensor-parallel block, because the sequence-parallel redistribution it
recomputes saves its DeviceMesh beside the tensors (`expected all
tensors_saved_with_vc_check to be Tensors`). The worker builds loom's tp 2 plan past the
refusal and runs one step.

The failure is asserted to still happen: the day torch saves the mesh as it should this
test fails, and the refusal should give way to a parity test (tests/parity/
test_layout_sweep.py) of compile with AC under tp and SimpleFSDP."""

from __future__ import annotations

import json

import pytest

from tests.harness import run_ranks

UPSTREAM = "expected all tensors_saved_with_vc_check to be Tensors"


@pytest.mark.multirank
def test_compiled_checkpointed_tp_block_still_fails_upstream() -> None:
    job = run_ranks(2, ["tests/workers/compiled_ac_tp_worker.py"], timeout=300)
    assert job.ok, job.describe()
    errors = [json.loads(r.stdout.strip().splitlines()[-1])["error"] for r in job.ranks]
    assert all(e is not None and UPSTREAM in e and "DeviceMesh" in e for e in errors), (
        f"compile with block AC at tp 2 now runs on this torch ({errors}): lift the "
        "--compile/--ac refusal in loom.config.compose and add parity layouts for it")
