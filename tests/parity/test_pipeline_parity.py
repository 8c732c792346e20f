"""Pipeline parity: the same seed and global batch on 1 process and under pipeline parallel
(each working schedule, and pp composed with dp, tp, AC, gradient accumulation and the
fused-linear and loss-parallel losses) give the same first-step gradients, per-step
losses, gradient norms and final parameters (fp32).

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
from tests.parity.test_moe_parity import COMMON as MOE_FLAGS  # moe-debug, fp32, 5 steps
from tests.parity.test_moe_parity import assert_losses_and_grad_norms_close
from tests.parity.test_parity import (
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
    "pp2_tp2_interleaved": (4, 1, [*PP2, "--tp", "2", "--pp-schedule", "interleaved-1f1b"]),
    "pp2_tp2_loss_parallel": (4, 1, [*PP2, "--tp", "2", "--loss-impl", "loss-parallel"]),
    "pp2_gpipe": (2, 1, [*PP2, "--pp-schedule", "gpipe"]),
    "pp2_ac": (2, 1, [*PP2, "--ac", "block"]),
    "pp2_accum": (2, 1, [*PP2, "--grad-accum-steps", "2", "--pp-microbatches", "2"]),
    "pp2_interleaved_ac": (2, 1, [*PP2, "--pp-schedule", "interleaved-1f1b", "--ac", "block"]),
    "pp2_fused_linear": (2, 1, [*PP2, "--loss-impl", "fused-linear"]),
    "pp2_tp2_fused_linear": (4, 1, [*PP2, "--tp", "2", "--loss-impl", "fused-linear"]),
}

V_LAYOUTS = {
    "pp2_zero_bubble": (2, 1, [*PP2, "--pp-schedule", "zero-bubble"]),
    "pp2_dualpipev": (2, 1, [*PP2, "--pp-schedule", "dualpipev"]),
    "pp2_dp2_zero_bubble": (4, 2, [*PP2, "--dp-shard", "2", "--pp-schedule", "zero-bubble"]),
}
"""The split-backward schedules (input gradients first, weight gradients deferred), each
stage one FSDP2 unit (`loom.parallel.fsdp.one_unit`; sharded over dp 2 in the last)."""
SLOW_V_LAYOUTS = {
    "pp2_tp2_dualpipev": (4, 1, [*PP2, "--tp", "2", "--pp-schedule", "dualpipev"]),
    "pp2_dp2_simple_fsdp_zero_bubble": (4, 2, [*PP2, "--dp-shard", "2", "--data-parallel",
                                               "simple-fsdp", "--pp-schedule", "zero-bubble"]),
}
"""The V schedules with tp 2 and with SimpleFSDP over dp 2 (a stage's parameters each
gathered on read, no FSDP2 unit to make one): another 4-rank job, so under slow."""


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


@pytest.fixture(scope="module")
def v_runs(tmp_path_factory) -> Path:
    return pipeline_runs(tmp_path_factory.mktemp("pp_parity_v"), V_LAYOUTS)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(V_LAYOUTS))
def test_v_schedules_match_one_process(v_runs: Path, layout: str) -> None:
    assert_matches_single(v_runs, layout, V_LAYOUTS)


@pytest.fixture(scope="module")
def slow_v_runs(tmp_path_factory) -> Path:
    return pipeline_runs(tmp_path_factory.mktemp("pp_parity_v_slow"), SLOW_V_LAYOUTS)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(SLOW_V_LAYOUTS))
def test_v_schedules_compose_with_tp_and_simple_fsdp(slow_v_runs: Path, layout: str) -> None:
    assert_matches_single(slow_v_runs, layout, SLOW_V_LAYOUTS)


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


INTERLEAVED = [*PP2, "--pp-schedule", "interleaved-1f1b"]  # 2 stages per rank
RESUME = [*COMMON, "--warmup-steps", "15", "--checkpoint-interval", "5", "--comm-timeout-s", "120"]
"""Warmup spans steps 1-10, so the learning rate does not depend on --max-steps (a run
stopped at 5 and one run to 10 share it) and the scheduler's state must come back. A rank
that fails to resume leaves the others in a collective: they give up after 2 minutes, not
the default 10."""
CKPT_LAYOUTS = {"pp2": [*PP2, "--batch-size", "4"], "dp2": ["--dp-shard", "2", "--batch-size", "2"],
                "interleaved": [*INTERLEAVED, "--batch-size", "4"],
                "interleaved_dp2": [*INTERLEAVED, "--dp-shard", "2", "--batch-size", "2"]}


def resumed(root: Path, src: str, dst: str, step: int, max_steps: int, base: list[str]
            ) -> list[str]:
    """`dst`'s flags resuming `src`'s checkpoint at `step`, to `max_steps`."""
    return [*base, *CKPT_LAYOUTS[dst], "--max-steps", str(max_steps), "--resume",
            str(root / src / "checkpoints" / f"step-{step}"), "--outdir",
            str(root / f"{src}-on-{dst}")]


@pytest.fixture(scope="module")
def layout_checkpoints(tmp_path_factory) -> Path:
    """One 2-rank job: pp2 and dp2 save at step 2 and load on each other; dp2 (pp 1) runs
    10 steps straight, saving at 5, and an interleaved pp2 run saves at 5; each resumes the
    other's step-5 checkpoint to step 10, and the interleaved one its own."""
    root = tmp_path_factory.mktemp("pp_checkpoints")
    moves = [*COMMON, "--checkpoint-interval", "2"]
    runs = [[*moves, *CKPT_LAYOUTS[name], "--max-steps", "2", "--outdir", str(root / name)]
            for name in ("pp2", "dp2")]
    runs += [resumed(root, src, dst, 2, 2, moves) for src, dst in (("pp2", "dp2"),
                                                                   ("dp2", "pp2"))]
    runs += [[*RESUME, *CKPT_LAYOUTS["dp2"], "--max-steps", "10", "--outdir",
              str(root / "straight")],
             [*RESUME, *CKPT_LAYOUTS["interleaved"], "--max-steps", "5", "--outdir",
              str(root / "interleaved")]]
    runs += [resumed(root, "interleaved", dst, 5, 10, RESUME) for dst in ("dp2", "interleaved")]
    runs += [resumed(root, "straight", "interleaved", 5, 10, RESUME)]
    job = run_ranks(2, ["tests/workers/parity_worker.py", json.dumps(runs)], timeout=900)
    assert job.ok, job.describe()
    return root


@pytest.mark.multirank
def test_checkpoints_move_between_pipeline_and_data_parallel(layout_checkpoints: Path) -> None:
    """A pp2 checkpoint loads on pp1 x dp2 and a dp2 one on pp2, bit-exact in parameters
    (stages keep the whole model's names, so DCP reshards across layouts)."""
    for src, dst in (("pp2", "dp2"), ("dp2", "pp2")):
        torch.testing.assert_close(torch.load(layout_checkpoints / f"{src}-on-{dst}" / "params.pt"),
                                   torch.load(layout_checkpoints / src / "params.pt"), rtol=0,
                                   atol=0, msg=lambda m, s=src, d=dst: f"{s} loaded on {d}: {m}")


def assert_continues(root: Path, run: str) -> None:
    """Steps 6-10 of a resumed run: the uninterrupted dp2 run's losses and gradient norms."""
    straight = root / "straight"
    assert sorted(column(straight)) == list(range(1, 11))
    for key in ("train/loss", "grad/norm_preclip"):
        expected = {s: v for s, v in column(straight, key).items() if s > 5}
        assert_series_close(column(root / run, key), expected, rtol=LOSS_RTOL, what=key)
    assert_norms_close(torch.load(root / run / "params.pt"),
                       torch.load(straight / "params.pt"), rtol=PARAM_NORM_RTOL,
                       what="parameters after 10 steps")


@pytest.mark.multirank
@pytest.mark.parametrize("run", ["interleaved-on-dp2", "straight-on-interleaved",
                                 "interleaved-on-interleaved"])
def test_interleaved_checkpoints_resume_on_one_stage_per_rank_and_back(
        layout_checkpoints: Path, run: str) -> None:
    """Two stages per rank save under the whole model's names: an interleaved pp2 step-5
    checkpoint resumes at pp 1 (dp2), and a pp 1 one resumes interleaved; steps 6-10 are
    the uninterrupted run's. Resumed on its own layout, pp rank 1 finds its stages'
    parameters in the optimizer groups rank 0 saved."""
    assert_continues(layout_checkpoints, run)


@pytest.mark.multirank
@pytest.mark.slow
def test_interleaved_checkpoint_resumes_on_pp2_dp2(layout_checkpoints: Path) -> None:
    """The interleaved pp2 step-5 checkpoint resumed interleaved at pp2 x dp2 (4 ranks)."""
    job = run_ranks(4, ["tests/workers/parity_worker.py", json.dumps([resumed(
        layout_checkpoints, "interleaved", "interleaved_dp2", 5, 10, RESUME)])], timeout=900)
    assert job.ok, job.describe()
    assert_continues(layout_checkpoints, "interleaved-on-interleaved_dp2")
