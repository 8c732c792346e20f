"""Pipeline parity: the same seed and global batch on 1 process and under pipeline parallel
(each working schedule, and pp composed with dp, tp, AC and gradient accumulation) give
the same first-step gradients, per-step losses, gradient norms and final parameters (fp32).

Gradients and parameters are gathered from every stage, so a stage that trains the wrong
layers, or a loss weighted per micro-batch instead of per token, shows up by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.compare import assert_norms_close, assert_series_close, assert_tensors_close, column
from tests.harness import run_ranks
from tests.test_moe_parity import COMMON as MOE_FLAGS  # moe-debug, fp32, 5 steps
from tests.test_moe_parity import assert_losses_and_grad_norms_close
from tests.test_parity import (
    COMMON,
    GLOBAL_BATCH,
    GRAD_ATOL,
    GRAD_RTOL,
    LOSS_RTOL,
    PARAM_NORM_RTOL,
)

PP2 = ["--pp", "2"]
LAYOUTS = {  # name: (world size, dp degree, flags)
    "pp2_1f1b": (2, 1, [*PP2, "--pp-schedule", "1f1b"]),
    "pp2_interleaved": (2, 1, [*PP2, "--pp-schedule", "interleaved-1f1b"]),
    "pp2_dp2": (4, 2, [*PP2, "--dp-shard", "2"]),
    "pp2_tp2": (4, 1, [*PP2, "--tp", "2"]),
}
SLOW_LAYOUTS = {
    "pp2_gpipe": (2, 1, [*PP2, "--pp-schedule", "gpipe"]),
    "pp2_ac": (2, 1, [*PP2, "--ac", "block"]),
    "pp2_accum": (2, 1, [*PP2, "--grad-accum-steps", "2", "--pp-microbatches", "2"]),
}


def launch(world: int, layouts: dict, root: Path, common: list[str] = COMMON,
           options: tuple[str, ...] = ("--first-grads",)) -> None:
    runs = []
    for name, (size, dp, flags) in layouts.items():
        if size != world:
            continue
        accum = int(flags[flags.index("--grad-accum-steps") + 1]) if "--grad-accum-steps" in \
            flags else 1
        runs.append([*common, *flags, "--batch-size", str(GLOBAL_BATCH // dp // accum),
                     "--outdir", str(root / name)])
    if runs:
        job = run_ranks(world, ["tests/workers/parity_worker.py", json.dumps(runs), *options],
                        timeout=1200)
        assert job.ok, job.describe()


def pipeline_runs(root: Path, layouts: dict) -> Path:
    launch(1, {"single": (1, 1, [])}, root)
    for world in (2, 4):
        launch(world, layouts, root)
    return root


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory) -> Path:
    return pipeline_runs(tmp_path_factory.mktemp("pp_parity"), LAYOUTS)


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory) -> Path:
    return pipeline_runs(tmp_path_factory.mktemp("pp_parity_slow"), SLOW_LAYOUTS)


def assert_matches_single(root: Path, layout: str, layouts: dict) -> None:
    single, run = root / "single", root / layout
    reference = column(single)
    assert len(reference) == 5 and reference[5] < reference[1], "training should make progress"
    if "--grad-accum-steps" not in layouts[layout][2]:  # else its first batch is a half one
        assert_tensors_close(torch.load(run / "first-grads.pt"),
                             torch.load(single / "first-grads.pt"), rtol=GRAD_RTOL,
                             atol=GRAD_ATOL, what="first-step gradient")
    for key in ("train/loss", "grad/norm_preclip"):
        assert_series_close(column(run, key), column(single, key), rtol=LOSS_RTOL, what=key)
    assert_norms_close(torch.load(run / "params.pt"), torch.load(single / "params.pt"),
                       rtol=PARAM_NORM_RTOL, what="parameters after 5 AdamW steps")


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_layout_matches_single_process(fast_runs: Path, layout: str) -> None:
    assert_matches_single(fast_runs, layout, LAYOUTS)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(SLOW_LAYOUTS))
def test_pipeline_layout_matches_single_process_slow(slow_runs: Path, layout: str) -> None:
    assert_matches_single(slow_runs, layout, SLOW_LAYOUTS)


@pytest.mark.multirank
@pytest.mark.slow
def test_moe_pp2_ep2_matches_single_process(tmp_path: Path) -> None:
    """MoE under pp2 x ep2 (the combination reported broken upstream): losses, gradient
    norms and final parameters of every stage. The routing-count metrics are not compared:
    rank 0 logs those of the layers its stage holds. Routing is not replayed (a stage's
    routers see micro-batches, which the recorded whole-batch picks do not index), so this
    case relies on no near tie flipping: none did in `python -m tests.moe_spread` under any
    capability measured, and the tolerances are the MoE parity tests' measured ones."""
    moe = {"single": (1, 1, []), "pp2_ep2": (4, 2, [*PP2, "--ep", "2"])}
    for world in (1, 4):
        launch(world, moe, tmp_path, MOE_FLAGS, options=())
    single, run = tmp_path / "single", tmp_path / "pp2_ep2"
    assert_losses_and_grad_norms_close(run, single)
    assert_norms_close(torch.load(run / "params.pt"), torch.load(single / "params.pt"),
                       rtol=PARAM_NORM_RTOL, what="parameters after 5 AdamW steps")


@pytest.mark.multirank
def test_checkpoints_move_between_pipeline_and_data_parallel(tmp_path: Path) -> None:
    """A pp2 checkpoint loads on pp1 x dp2 and a dp2 one on pp2, bit-exact in parameters
    (stages keep the whole model's names, so DCP reshards across layouts)."""
    base = [*COMMON, "--checkpoint-interval", "2"]
    layouts = {"pp2": [*PP2, "--batch-size", "4"], "dp2": ["--dp-shard", "2", "--batch-size", "2"]}
    runs = [[*base, *layouts[name], "--max-steps", "2", "--outdir", str(tmp_path / name)]
            for name in layouts]
    runs += [[*base, *layouts[dst], "--max-steps", "2", "--resume",
              str(tmp_path / src / "checkpoints" / "step-2"), "--outdir",
              str(tmp_path / f"{src}-on-{dst}")] for src, dst in (("pp2", "dp2"), ("dp2", "pp2"))]
    job = run_ranks(2, ["tests/workers/parity_worker.py", json.dumps(runs)], timeout=900)
    assert job.ok, job.describe()
    for src, dst in (("pp2", "dp2"), ("dp2", "pp2")):
        torch.testing.assert_close(torch.load(tmp_path / f"{src}-on-{dst}" / "params.pt"),
                                   torch.load(tmp_path / src / "params.pt"), rtol=0, atol=0,
                                   msg=lambda m, s=src, d=dst: f"{s} loaded on {d}: {m}")
