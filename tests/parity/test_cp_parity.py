"""Context parallel parity: the same seed and global batch on 1 process and under each cp
layout give the same first-step gradients, per-step losses and final parameters (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.compare import assert_norms_close, assert_series_close, column
from tests.parity.test_parity import LOSS_RTOL, PARAM_NORM_RTOL, assert_matches_single, run_layouts

LAYOUTS = {  # name: (world size, flags); seq 64 splits into 2 x cp chunks (and tp within)
    "cp2": (2, ["--cp", "2"]),
    "cp2_fused_linear": (2, ["--cp", "2", "--loss-impl", "fused-linear",
                             "--loss-chunk-size", "16"]),
}
"""The default selection's cp layouts: one 2-rank job. cp's compositions with dp, tp, AC,
SimpleFSDP and cp 4 are in `SLOW_LAYOUTS` (and the layout sweep), to keep the default
selection within its budget."""


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cp-parity")
    run_layouts(1, ["single"], root, LAYOUTS)
    run_layouts(2, list(LAYOUTS), root, LAYOUTS)
    return root


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cp_layout_matches_single_process(cp_runs: Path, layout: str) -> None:
    assert_matches_single(cp_runs, layout)


SLOW_LAYOUTS = {
    "cp2_ac": (2, ["--cp", "2", "--ac", "block"]),
    "cp4": (4, ["--cp", "4"]),
    "cp2_dp2": (4, ["--cp", "2", "--dp-shard", "2"]),
    "cp2_tp2": (4, ["--cp", "2", "--tp", "2"]),
    "cp2_simple_fsdp": (2, ["--cp", "2", "--data-parallel", "simple-fsdp"]),
    "cp2_compile": (2, ["--cp", "2", "--compile", "--compile-backend", "aot_eager"]),
    "cp2_save": (2, ["--cp", "2", "--checkpoint-interval", "2", "--keep-checkpoints", "3"]),
    "cp2_tp2_selective_ac": (4, ["--cp", "2", "--tp", "2", "--ac", "selective",
                                 "--loss-impl", "loss-parallel"]),
    "cp2_hsdp": (4, ["--cp", "2", "--dp-replicate", "2", "--dp-shard", "1"]),
    "cp2_tp2_simple_fsdp": (4, ["--cp", "2", "--tp", "2", "--data-parallel", "simple-fsdp"]),
    "cp2_dp2_simple_fsdp": (4, ["--cp", "2", "--dp-shard", "2", "--data-parallel",
                                "simple-fsdp"]),  # the default's cp2_simple_fsdp x cp2_dp2
    "cp2_chunked": (2, ["--cp", "2", "--loss-impl", "chunked", "--loss-chunk-size", "16"]),
    "cp2_chunked_backward": (2, ["--cp", "2", "--loss-impl", "chunked-backward",
                                 "--loss-chunk-size", "16"]),
    "cp2_compiled_loss": (2, ["--cp", "2", "--loss-impl", "compiled"]),
}


@pytest.fixture(scope="module")
def slow_cp_runs(cp_runs: Path) -> Path:
    """Compiled blocks, selective AC with vocab-parallel loss, HSDP, the chunked and compiled
    loss modes, and a cp 2 checkpoint resumed on cp 4 (its runs land next to the default ones,
    sharing their single-process run)."""
    step2 = cp_runs / "cp2_save" / "checkpoints" / "step-2"
    layouts = {**SLOW_LAYOUTS, "cp4_resumed": (4, ["--cp", "4", "--resume", str(step2)])}
    run_layouts(2, [n for n, (w, _) in layouts.items() if w == 2], cp_runs, layouts)
    run_layouts(4, [n for n, (w, _) in layouts.items() if w == 4], cp_runs, layouts)
    return cp_runs


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(SLOW_LAYOUTS))
def test_slow_cp_layout_matches_single_process(slow_cp_runs: Path, layout: str) -> None:
    assert_matches_single(slow_cp_runs, layout)


@pytest.mark.slow
@pytest.mark.multirank
def test_cp2_checkpoint_resumes_on_cp4(slow_cp_runs: Path) -> None:
    single, resumed = slow_cp_runs / "single", slow_cp_runs / "cp4_resumed"
    reference = {step: loss for step, loss in column(single).items() if step > 2}
    assert_series_close(column(resumed), reference, rtol=LOSS_RTOL)
    assert_norms_close(torch.load(resumed / "params.pt"), torch.load(single / "params.pt"),
                       rtol=PARAM_NORM_RTOL, what="parameters after resuming on cp 4")
