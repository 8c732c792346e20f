"""The upstream failure `loom.parallel.parallelize.checkpoint_outside_compile` works around,
reproduced per torch version: AOT autograd fails at the first backward of a compiled region
holding a checkpointed DTensor redistribution (tensor parallel's sequence-parallel
transitions, SimpleFSDP's gathers), because the recompute's DeviceMesh is saved among the
tensors (`expected all tensors_saved_with_vc_check to be Tensors`). torchtitan 0.2.2's own
apply_tp + apply_ac + apply_compile fails the same way on torch 2.13.0; 2.11.0 and 2.15.0
run it. The worker forces that order (checkpoint inside the graph) on loom's tp 2 and
SimpleFSDP plans.

`loom.compat.checkpoint_inside_compile_saves_mesh` names the versions that fail; this test
asserts exactly that, so it fails the day a listed version stops failing (drop it from the
list: loom goes back to torch's order there) or an unlisted one starts."""

from __future__ import annotations

import json

import pytest
import torch

from loom.compat import checkpoint_inside_compile_saves_mesh
from tests.harness import run_ranks

UPSTREAM = "expected all tensors_saved_with_vc_check to be Tensors"


@pytest.mark.multirank
def test_checkpoint_inside_a_compiled_dtensor_block_fails_only_where_compat_says() -> None:
    job = run_ranks(2, ["tests/workers/compiled_ac_tp_worker.py", "tp", "simple-fsdp"],
                    timeout=600)
    assert job.ok, job.describe()
    ranks = [json.loads(r.stdout.strip().splitlines()[-1]) for r in job.ranks]
    errors = [e for rank in ranks for e in rank.values()]
    if checkpoint_inside_compile_saves_mesh():
        assert all(e is not None and UPSTREAM in e and "DeviceMesh" in e for e in errors), (
            f"torch {torch.__version__} now runs a checkpoint inside a compiled tp / "
            f"SimpleFSDP block ({ranks}): drop it from loom.compat."
            "checkpoint_inside_compile_saves_mesh")
    else:
        assert all(e is None for e in errors), (
            f"torch {torch.__version__} fails a checkpoint inside a compiled tp / SimpleFSDP "
            f"block ({ranks}): add it to loom.compat.checkpoint_inside_compile_saves_mesh")
