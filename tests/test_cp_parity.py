"""Context parallel parity: the same seed and global batch on 1 process and under each cp
layout give the same first-step gradients, per-step losses and final parameters (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_parity import assert_matches_single, run_layouts

LAYOUTS = {  # name: (world size, flags); seq 64 splits into 2 x cp chunks (and tp within)
    "cp2": (2, ["--cp", "2"]),
    "cp2_ac": (2, ["--cp", "2", "--ac", "block"]),
    "cp2_fused_linear": (2, ["--cp", "2", "--loss-impl", "fused-linear",
                             "--loss-chunk-size", "16"]),
    "cp4": (4, ["--cp", "4"]),
    "cp2_dp2": (4, ["--cp", "2", "--dp-shard", "2"]),
    "cp2_tp2": (4, ["--cp", "2", "--tp", "2"]),
}


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cp-parity")
    run_layouts(1, ["single"], root, LAYOUTS)
    for world in (2, 4):
        run_layouts(world, [n for n, (w, _) in LAYOUTS.items() if w == world], root, LAYOUTS)
    return root


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cp_layout_matches_single_process(cp_runs: Path, layout: str) -> None:
    assert_matches_single(cp_runs, layout)
