"""`loom verify` on 4 ranks (debug model, fp32, 3 steps): layouts that agree exit 0; a layout
with a known difference (its own --lr, through the per-layout flags) exits 1 and is named in
the table with the first parameter that differs. Only rank 0 writes to stdout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import JobResult, run_ranks

TRAIN = ["--model", "debug", "--dataset", "random", "--vocab-size", "512", "--seq-len", "64",
         "--fp32", "--seed", "7", "--lr", "1e-3"]


def verify(tmp_path: Path, *options: str) -> JobResult:
    return run_ranks(4, ["-m", "loom", "verify", *options, "--steps", "3", "--outdir",
                         str(tmp_path), *TRAIN], timeout=900)


@pytest.mark.multirank
def test_agreeing_layouts_exit_0(tmp_path: Path) -> None:
    job = verify(tmp_path, "--layouts", "dp4", "dp2 tp2", "pp2 dp2", "hsdp2x2", "--json")
    assert job.ok, job.describe()
    result = json.loads(job.ranks[0].stdout)
    assert result["reference"] == "dp4"
    assert [v["layout"] for v in result["layouts"]] == ["dp2 tp2", "pp2 dp2", "hsdp2x2"]
    for v in result["layouts"]:
        assert v["ok"] and v["first_differing"] is None, v
        assert v["loss"] <= 1e-5 and v["grad_norm"] <= 1e-5 and v["params"] <= 1e-3, v
    assert all(r.stdout == "" for r in job.ranks[1:])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "0-dp4", "1-dp2_tp2", "2-pp2_dp2", "3-hsdp2x2"]


@pytest.mark.multirank
def test_a_differing_layout_exits_1_and_names_the_first_differing_parameter(
        tmp_path: Path) -> None:
    """Against the reference alone (agreeing layouts' rows are the test above's)."""
    job = verify(tmp_path, "--layouts", "dp4", "dp4 --lr 2e-3")
    assert [r.returncode for r in job.ranks] == [1] * 4, job.describe()
    table = job.ranks[0].stdout.splitlines()
    differ = next(line for line in table if line.startswith("dp4 --lr 2e-3"))
    assert differ.split()[-2:] == ["FAIL", "tok_embeddings.weight"], table
    assert "Traceback" not in job.ranks[0].stderr
