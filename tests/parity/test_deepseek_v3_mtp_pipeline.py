"""DeepSeek-V3 multi-token prediction under the pipeline layouts test_deepseek_v3_parity.py
leaves out: pp with cp, and the V-shaped schedules (zero-bubble, DualPipeV), each against
one process (losses, gradient norms, final parameters, the MTP loss metric; fp32). The
single-process reference runs here, so none of these starts the family's whole two-rank
sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loom.compat import v_schedules_send_to_own_rank
from loom.config import parse_args
from loom.errors import ConfigError
from tests.compare import assert_series_close, column
from tests.harness import run_ranks
from tests.parity.test_deepseek_v3_parity import COMMON, GLOBAL_BATCH, MTP, assert_pp2_matches

V_LAYOUTS = {  # name: (world size, flags)
    "zero-bubble": (2, ["--pp-schedule", "zero-bubble"]),
    "dualpipev": (2, ["--pp-schedule", "dualpipev"]),
    "dualpipev_cp2": (4, ["--pp-schedule", "dualpipev", "--cp", "2"]),
}
"""The V schedules at pp 2, and DualPipeV with cp 2 (the ids gathered on every stage): the
embedding, the three blocks and the head cut into four stages, two per rank."""


def assert_mtp_pp2_matches(tmp_path: Path, reference: Path, flags: list[str],
                           world: int = 2) -> None:
    """The pp 2 checks (losses, gradient norms, parameters), and the MTP loss metric, the
    last stage's (summed over the stages of the pipeline)."""
    assert_pp2_matches(tmp_path, reference, [*MTP, *flags], world=world)
    assert_series_close(column(tmp_path / "pp2", "mtp/loss"), column(reference, "mtp/loss"),
                        rtol=1e-5, what="mtp/loss")


@pytest.fixture(scope="module")
def mtp_reference(tmp_path_factory) -> Path:
    """One process's MTP run (test_deepseek_v3_parity.py's `mtp_single`): the reference."""
    root = tmp_path_factory.mktemp("mtp_pipeline")
    job = run_ranks(1, ["tests/workers/parity_worker.py", json.dumps(
        [[*COMMON, *MTP, "--batch-size", str(GLOBAL_BATCH), "--outdir",
          str(root / "mtp_single")]])], timeout=1200)
    assert job.ok, job.describe()
    return root / "mtp_single"


@pytest.mark.multirank
@pytest.mark.slow
def test_slow_mtp_pp2_cp2_matches_single_process(mtp_reference: Path, tmp_path: Path,
                                                 ) -> None:
    """pp 2 x cp 2: every stage gathers the micro-batch's ids the schedule hands it (this cp
    rank's shard) over cp, the first to embed each depth's shifted ids at its positions,
    the last to score the MTP depths at its positions against the whole sequences."""
    assert_mtp_pp2_matches(tmp_path, mtp_reference, ["--cp", "2"], world=4)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(V_LAYOUTS))
def test_slow_mtp_pp2_v_schedule_matches_single_process(request: pytest.FixtureRequest,
                                                        tmp_path: Path, layout: str) -> None:
    """The V: rank 0 holds the first and the last stage (the embedding, and the MTP module
    with the head), the split backward defers the weight gradients of every stage. Where
    torch cannot run a V over gloo (2.11-2.12) the configuration is refused in one line."""
    world, flags = V_LAYOUTS[layout]
    if v_schedules_send_to_own_rank():
        with pytest.raises(ConfigError, match="needs torch 2.13 or newer"):
            parse_args([*COMMON, *MTP, "--pp", "2", *flags])
        return
    reference = request.getfixturevalue("mtp_reference")  # not built if refused
    assert_mtp_pp2_matches(tmp_path, reference, flags, world=world)
