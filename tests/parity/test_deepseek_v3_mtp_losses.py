"""DeepSeek-V3 multi-token prediction scored by the criterion: with every loss mode and the
document mask it matches one process (losses, gradient norms, routing, final parameters and
the `mtp/loss` metric; fp32). The depths are scored against the labels d ahead with the
main loss's mode, so a depth scored on the wrong rows, a vocabulary shard taken as the
whole (loss-parallel), a depth label taken from another rank's shard or another document
(cp with --doc-mask), or a depth weighed by the wrong token count moves them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import run_ranks
from tests.parity.test_deepseek_v3_parity import (
    COMMON,
    GLOBAL_BATCH,
    MTP,
    assert_matches_reference,
)

DOC_MASK = ["--doc-mask"]
REFERENCES = {"mtp_single": [], "mtp_doc_single": DOC_MASK}
"""One process, the default loss (eager), with and without --doc-mask (the random data's
end-of-text is its most frequent id, so every window packs many documents)."""
LAYOUTS = {  # name: (world size, dp degree, flags, reference)
    "fused_linear_dp2": (2, 2, ["--loss-impl", "fused-linear", "--dp-shard", "2"],
                         "mtp_single"),
    "chunked_dp2": (2, 2, ["--loss-impl", "chunked", "--dp-shard", "2"], "mtp_single"),
    "loss_parallel_tp2": (2, 1, ["--loss-impl", "loss-parallel", "--tp", "2"], "mtp_single"),
    "doc_mask_cp2": (2, 1, [*DOC_MASK, "--cp", "2"], "mtp_doc_single"),
}
"""fused-linear inside the forward (the head's FSDP2 unit) at dp 2, chunked at dp 2,
vocabulary-sharded logits at tp 2, and the document mask over cp shards (each depth's
labels gathered from the whole sequences, masked at document ends, re-sharded)."""
SLOW_LAYOUTS = {
    "fused_linear_tp2": (2, 1, ["--loss-impl", "fused-linear", "--tp", "2"], "mtp_single"),
    "doc_mask_fused_linear_tp2": (2, 1, [*DOC_MASK, "--loss-impl", "fused-linear", "--tp",
                                         "2"], "mtp_doc_single"),
}
"""fused-linear on the returned hidden states with the head's weight vocabulary-sharded
(tp 2), and with the document mask (under --pp it is refused: `DeepseekV3Flags.check`)."""


def launch(world: int, layouts: dict, root: Path, references: Path) -> None:
    runs = [{"argv": [*COMMON, *MTP, *flags, "--batch-size", str(GLOBAL_BATCH // dp),
                      "--outdir", str(root / name)],
             "routing": "record" if reference is None else str(references / reference)}
            for name, (size, dp, flags, reference) in layouts.items() if size == world]
    job = run_ranks(world, ["tests/workers/parity_worker.py", json.dumps(runs)],
                    timeout=1200)
    assert job.ok, job.describe()


@pytest.fixture(scope="module")
def mtp_loss_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mtp_losses")
    launch(1, {name: (1, 1, flags, None) for name, flags in REFERENCES.items()}, root, root)
    launch(2, LAYOUTS, root, root)
    return root


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mtp_loss_mode_matches_single_process(mtp_loss_runs: Path, layout: str) -> None:
    assert_matches_reference(mtp_loss_runs / layout, mtp_loss_runs / LAYOUTS[layout][3])


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(SLOW_LAYOUTS))
def test_slow_mtp_loss_mode_matches_single_process(mtp_loss_runs: Path, tmp_path: Path,
                                                   layout: str) -> None:
    launch(2, {layout: SLOW_LAYOUTS[layout]}, tmp_path, mtp_loss_runs)
    assert_matches_reference(tmp_path / layout, mtp_loss_runs / SLOW_LAYOUTS[layout][3])
