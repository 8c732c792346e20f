"""Memory and speed knobs keep the numerics: on 2 ranks (dp 2, and dp 1 x tp 2) activation
checkpointing matches the plain run in losses and gradients, and per-block compile
(aot_eager here; inductor runs in the launch test) matches it in losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.compare import assert_tensors_close, losses
from tests.harness import REPO, run_ranks

COMMON = ["--model", "debug", "--dataset", "random", "--vocab-size", "512", "--seq-len", "64",
          "--fp32", "--max-steps", "5", "--seed", "11", "--lr", "1e-3"]
LAYOUTS = {"dp2": ["--dp-shard", "2", "--batch-size", "2"],  # global batch 4 in both
           "tp2": ["--tp", "2", "--batch-size", "4"]}
KNOBS = {"none": [], "block": ["--ac", "block"], "selective": ["--ac", "selective"],
         "op": ["--ac", "op"],
         "compile": ["--compile"], "compile_budget": ["--compile", "--act-mem-budget", "0.5"]}
AC_ATOL = 1e-6
COMPILE_ATOL = 1e-4


SLOW_CELLS = {("tp2", "selective"), ("tp2", "op"), ("tp2", "compile_budget")}
"""Run in the slow selection: selective and op checkpointing and the memory budget wrap the
same modules at tp 2 as at dp 2 (the default selection's cells); block AC and compile keep
their tp 2 cells there."""


def cells(knobs: list[str]) -> list:
    return [pytest.param(layout, knob, marks=pytest.mark.slow) if (layout, knob) in SLOW_CELLS
            else (layout, knob) for layout in LAYOUTS for knob in knobs]


def train(root: Path, names: list[tuple[str, str]]) -> str:
    """The (layout, knob) runs into `root` in one 2-rank job; rank 0's stdout."""
    runs = [[*COMMON, *LAYOUTS[layout], *KNOBS[knob], "--outdir", str(root / f"{layout}-{knob}")]
            for layout, knob in names]
    job = run_ranks(2, ["tests/workers/parity_worker.py", json.dumps(runs), "--grads"],
                    timeout=1200, env={"LOOM_COMPILE_BACKEND": "aot_eager"})
    assert job.ok, job.describe()
    return job.ranks[0].stdout


@pytest.fixture(scope="module")
def default_knob_runs(tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("knobs")
    return root, train(root, [(layout, knob) for layout in LAYOUTS for knob in KNOBS
                              if (layout, knob) not in SLOW_CELLS])


@pytest.fixture(scope="module")
def slow_knob_runs(default_knob_runs) -> tuple[Path, str]:
    root, _ = default_knob_runs  # beside the plain runs they are compared with
    return root, train(root, sorted(SLOW_CELLS))


@pytest.fixture
def knob_runs(request, layout: str, knob: str) -> tuple[Path, str]:
    slow = (layout, knob) in SLOW_CELLS
    return request.getfixturevalue("slow_knob_runs" if slow else "default_knob_runs")


@pytest.mark.multirank
@pytest.mark.parametrize(("layout", "knob"), cells(["block", "selective", "op"]))
def test_activation_checkpointing_matches_plain_run(knob_runs, layout: str, knob: str) -> None:
    root, _ = knob_runs
    plain, ac = root / f"{layout}-none", root / f"{layout}-{knob}"
    reference = losses(plain)
    assert len(reference) == 5 and reference[-1] < reference[0]
    torch.testing.assert_close(losses(ac), reference, rtol=0, atol=AC_ATOL)
    ref_grads, grads = torch.load(plain / "grads.pt"), torch.load(ac / "grads.pt")
    assert grads.keys() == ref_grads.keys()
    assert all(g.abs().sum() > 0 for g in ref_grads.values())
    assert_tensors_close(grads, ref_grads, rtol=0, atol=AC_ATOL,
                         what="gradients at the final weights")


@pytest.mark.multirank
@pytest.mark.parametrize(("layout", "knob"), cells(["compile", "compile_budget"]))
def test_compile_matches_plain_run(knob_runs, layout: str, knob: str) -> None:
    root, stdout = knob_runs
    assert "compiled 4 blocks (aot_eager" in stdout
    torch.testing.assert_close(losses(root / f"{layout}-{knob}"), losses(root / f"{layout}-none"),
                               rtol=0, atol=COMPILE_ATOL)


@pytest.mark.multirank
def test_launch_compile_with_block_checkpointing(tmp_path: Path) -> None:
    """The documented command, with inductor: 2 ranks, tp 1, compile + block AC, 5 steps
    (fp32: bf16 matmuls are 10-50x slower on CPUs without native bf16)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(REPO / "src"), os.environ.get("PYTHONPATH")]))}
    env.pop("LOOM_COMPILE_BACKEND", None)
    cmd = [sys.executable, "-m", "loom", "launch", "-n", "2", sys.executable, "-m", "loom",
           "train", "--model", "debug", "--dataset", "random", "--compile", "--ac", "block",
           "--fp32", "--max-steps", "5", "--outdir", str(tmp_path)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "activation checkpointing (block): wrapped 4 blocks" in result.stdout
    assert "compiled 4 blocks (inductor" in result.stdout
    trace = losses(tmp_path)
    assert len(trace) == 5 and torch.isfinite(trace).all() and trace[-1] < trace[0]
