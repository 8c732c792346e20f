"""--doc-mask under tp2 (with activation checkpointing), pp2 and cp2 against one process:
the same first-step gradients, losses, gradient norms and final parameters (fp32). A
pipeline stage that did not get the batch's documents, or a cp rank whose mask did not
follow its load-balanced chunks (documents span them), would differ.
The synthetic data's end-of-text is its most frequent id, so every window packs many
documents."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parity.test_parity import COMMON
from tests.parity.test_pipeline_parity import PP2, assert_matches_single, launch

DOC_MASK = [*COMMON, "--doc-mask"]
LAYOUTS = {  # name: (world size, dp degree, flags)
    "tp2_ac": (2, 1, ["--tp", "2", "--ac", "block"]),
    "pp2": (2, 1, PP2),
    "cp2": (2, 1, ["--cp", "2"]),
}


@pytest.fixture(scope="module")
def doc_mask_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("doc_mask_parity")
    launch(1, {"single": (1, 1, [])}, root, DOC_MASK)
    launch(2, LAYOUTS, root, DOC_MASK)  # both layouts in one launch
    return root


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_doc_mask_layout_matches_single_process(doc_mask_runs: Path, layout: str) -> None:
    assert_matches_single(doc_mask_runs, layout, LAYOUTS)
