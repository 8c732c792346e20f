"""MoE parity: the same seed and global batch on 1 process and under expert parallel (with
FSDP, TP, ETP, HSDP, AC + compile) and MoE + TP alone give the same per-step losses,
gradient norms, routing counts and final parameters (fp32).

Losses alone would miss a wrong expert-gradient scale (AdamW normalises it away); the
pre-clip gradient norms and the final parameters do not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.compare import assert_norms_close, assert_series_close, column, rows
from tests.harness import run_ranks

GLOBAL_BATCH = 4
COMMON = ["--model", "moe-debug", "--dataset", "random", "--vocab-size", "512",
          "--seq-len", "64", "--fp32", "--max-steps", "5", "--seed", "7", "--lr", "1e-3",
          "--warmup-steps", "0"]
RTOL = 1e-5
PARAM_NORM_RTOL = 1e-3
"""Per tensor, as in test_parity.py: AdamW can turn a reduction-order difference on a ~0
gradient into a 2 * lr step on one element, so final parameters are compared norm-wise."""
COMPILE = ["--compile", "--compile-backend", "aot_eager"]
FEW_EXPERTS = ["--n-experts", "2", "--top-k", "1"]
"""Fewer (local) experts than FSDP shard ranks: the stacked expert weights are sharded off
dim 0 (`expert_placement`). Compared with their own single-process run (`few_single`)."""

LAYOUTS = {  # name: (world size, dp degree, flags)
    "single": (1, 1, []),
    "ep2": (4, 4, ["--ep", "2"]),
    "ep4": (4, 4, ["--ep", "4"]),
    "dp2_tp2_etp1": (4, 2, ["--tp", "2"]),
    "dp2_tp2_etp2": (4, 2, ["--tp", "2", "--etp", "2"]),
    "dp2_tp2_ep2_etp1": (4, 2, ["--tp", "2", "--ep", "2", "--etp", "1"]),
    "dp2_tp2_ep2_etp2": (4, 2, ["--tp", "2", "--ep", "2", "--etp", "2"]),
    "hsdp2x2_ep2": (4, 4, ["--dp-replicate", "2", "--dp-shard", "2", "--ep", "2"]),
    "ep2_ac_compile": (4, 4, ["--ep", "2", "--ac", "block", *COMPILE]),
    "few_single": (1, 1, FEW_EXPERTS),
    "few_dp4": (4, 4, FEW_EXPERTS),
    "few_ep2": (4, 4, [*FEW_EXPERTS, "--ep", "2"]),
}
SINGLES = ("single", "few_single")
SLOW_LAYOUTS = {
    "dp2_tp2_ep2_etp1_compile": (4, 2, ["--tp", "2", "--ep", "2", *COMPILE]),
}


def launch(world: int, layouts: dict, root: Path) -> None:
    runs = [[*COMMON, *flags, "--batch-size", str(GLOBAL_BATCH // dp), "--outdir",
             str(root / name)] for name, (size, dp, flags) in layouts.items() if size == world]
    job = run_ranks(world, ["tests/workers/parity_worker.py", json.dumps(runs)], timeout=1200)
    assert job.ok, job.describe()


def assert_same_run(candidate: Path, reference: Path) -> None:
    for key in ("train/loss", "grad/norm_preclip"):
        assert_series_close(column(candidate, key), column(reference, key), rtol=RTOL, what=key)
    ref, new = rows(reference), rows(candidate)
    assert len(new) == len(ref) == 5
    for key in ("moe/tokens_per_expert_min", "moe/tokens_per_expert_max"):
        assert [r[key] for r in new] == [r[key] for r in ref], key
    assert_norms_close(torch.load(candidate / "params.pt"), torch.load(reference / "params.pt"),
                       rtol=PARAM_NORM_RTOL, what="parameters after 5 AdamW steps")


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe_parity")
    launch(1, LAYOUTS, root)
    launch(4, LAYOUTS, root)
    return root


@pytest.mark.multirank
def test_single_process_reference_trains(moe_runs: Path) -> None:
    losses = column(moe_runs / "single")
    assert losses[5] < losses[1], "training should make progress"


@pytest.mark.multirank
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name not in SINGLES])
def test_layout_matches_single_process(moe_runs: Path, layout: str) -> None:
    reference = "few_single" if layout.startswith("few_") else "single"
    assert_same_run(moe_runs / layout, moe_runs / reference)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(SLOW_LAYOUTS))
def test_slow_layout_matches_single_process(moe_runs: Path, tmp_path: Path, layout: str) -> None:
    launch(4, SLOW_LAYOUTS, tmp_path)
    assert_same_run(tmp_path / layout, moe_runs / "single")
