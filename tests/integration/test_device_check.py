"""benchmarks/device_check.sh in its tiny CPU mode: every section runs, the table and the
JSON come out, so the script is known to work before a GPU is ever lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness import REPO

SCRIPT = REPO / "benchmarks" / "device_check.sh"
LOSSES = ["eager", "chunked", "fused-linear"]
EXPECTED = ["train-s-compiled", *(f"loss-{loss}-b{batch}" for batch in (1, 2) for loss in LOSSES)]


def run_script(mode: str, runs: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LOOM_DEVICE_CHECK": mode, "LOOM_DEVICE_CHECK_RUNS": runs,
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.slow  # ~90 s of plans and runs; the issue allows the tiny mode as a slow test
def test_tiny_mode_runs_every_section(tmp_path):
    proc = run_script("tiny", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "device_check.json").read_text())
    runs = {r["run"]: r for r in result["runs"]}
    assert list(runs) == EXPECTED, list(runs)
    failed = {name: r["status"] for name, r in runs.items() if r["status"] != "ok"}
    assert not failed, failed
    for name, r in runs.items():
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["alloc_peak_gib"] > 0, (name, r)
        assert r["mfu"] is None or 0 < r["mfu"] <= 100, (name, r)
        assert r["plan_step_s"] > 0 and r["plan_peak_gib"] > 0, (name, r)
        assert r["step_err_pct"] is not None and r["alloc_err_pct"] is not None, (name, r)
    assert runs["train-s-compiled"]["ac"] == "none", "the toy fits without recompute"
    assert [runs[f"loss-eager-b{b}"]["batch"] for b in (1, 2)] == [1, 2]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + len(EXPECTED), proc.stdout
    assert (tmp_path / "device_check.md").read_text().splitlines() == table


def test_unknown_mode_is_one_line_and_exit_2(tmp_path):
    proc = run_script("cuda-please", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "LOOM_DEVICE_CHECK must be gpu or tiny" in proc.stderr
