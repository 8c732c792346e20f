"""`loom.fit` from Python: several runs in one process, each as a fresh process would run
it, every process-wide setting back after each; errors raised (never SystemExit), and the
process group it started torn down after a failure too, a caller's own left alone."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch.distributed as dist

import loom
from loom.config import ConfigError, parse_args
from loom.errors import NonFiniteLossError
from tests.one_rank import one_rank_group
from tests.unit.runtime.test_scope import changed, global_state

TINY = ["--model", "debug", "--n-layers", "2", "--dataset", "random", "--vocab-size", "256",
        "--seq-len", "32", "--batch-size", "2", "--fp32", "--max-steps", "3", "--seed", "3"]
COMPILED = ["--compile", "--compile-backend", "aot_eager", "--act-mem-budget", "0.5"]
"""aot_eager: the same partitioner (it reads the budget) without inductor's code generation."""


def test_import_loom_does_not_import_torch():
    """`loom.fit` is loaded on first use (the CLI's --version and flag checks stay light)."""
    out = subprocess.run([sys.executable, "-c", "import loom, sys; "
                          "print('torch' in sys.modules, 'fit' in loom.__all__)"],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr
    assert callable(loom.fit)


def test_a_run_without_replica_groups_never_imports_torchft(tmp_path):
    """torchft is the optional `ft` extra: only --ft-replica-groups imports it."""
    code = ("import sys, loom; loom.fit(sys.argv[1:]); "
            "print('torchft' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, *TINY, "--outdir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[-2:] == ["False", "True"], out.stderr[-3000:]


def test_two_fits_in_one_process_leave_no_trace(tmp_path):
    """An eager run, a compiled one with an activation budget, the eager one again: the
    third has the first's losses exactly, the compiled one the same within fp32 rounding,
    and after each every compiler option, logger level and warning filter is as before."""
    before = global_state()
    first = loom.fit([*TINY, "--outdir", str(tmp_path / "first")])
    assert changed(before, global_state()) == {}
    compiled = loom.fit(parse_args([*TINY, *COMPILED, "--outdir", str(tmp_path / "compiled")]))
    assert changed(before, global_state()) == {}, "the compiled run left a setting behind"
    again = loom.fit([*TINY, "--outdir", str(tmp_path / "again")])
    assert changed(before, global_state()) == {}
    assert not dist.is_initialized()
    assert (first.step, compiled.step, again.step) == (3, 3, 3)
    assert sorted(first.losses) == [1, 2, 3]
    assert again.losses == first.losses
    assert compiled.losses == pytest.approx(first.losses, rel=1e-5)
    assert first.outdir == tmp_path / "first" and first.summary["steps"] == 3
    assert (first.outdir / "config.json").is_file()


def test_a_failing_fit_raises_and_leaves_no_process_group(tmp_path):
    before = global_state()
    with pytest.raises(ConfigError, match="missing"):
        loom.fit([*TINY, *COMPILED, "--dataset", str(tmp_path / "missing"),
                  "--outdir", str(tmp_path / "bad-data")])
    assert not dist.is_initialized()
    retried = loom.fit([*TINY, "--max-steps", "1", "--outdir", str(tmp_path / "bad-data")])
    assert retried.step == 1, "the failed start-up kept the run folder"
    with pytest.raises(NonFiniteLossError):  # a failure in the step itself
        loom.fit([*TINY, "--lr", "1e30", "--max-grad-norm", "0", "--outdir",
                  str(tmp_path / "diverged")])
    assert not dist.is_initialized()
    assert changed(before, global_state()) == {}
    for asked in (["--help"], ["--print-config"]):
        with pytest.raises(ConfigError, match="command line"):
            loom.fit([*TINY, *asked])
    with pytest.raises(ConfigError, match="list"):
        loom.fit(" ".join(TINY))


def test_a_callers_process_group_is_used_and_left_up(tmp_path):
    with one_rank_group():
        result = loom.fit([*TINY, "--max-steps", "1", "--outdir", str(tmp_path / "mine")])
        assert result.step == 1 and dist.is_initialized()
        with pytest.raises(ConfigError):
            loom.fit([*TINY, "--dataset", str(tmp_path / "missing"),
                      "--outdir", str(tmp_path / "bad")])
        assert dist.is_initialized(), "a failure tore down the caller's group"
