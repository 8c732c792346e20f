"""`loom.fit` leaves the process as it found it: `sys.excepthook` is the caller's again
after each call (starting a process group wraps it in torch's `[rankN]:` prefixer, so
before the fix every call wrapped it once more and an error printed `[rank0]: [rank0]: ...`),
after a failed call too; and a config of the wrong type, or a JobConfig built in Python
with a bad value, is a ConfigError naming what is wrong, never a TypeError."""

from __future__ import annotations

import io
import sys
from dataclasses import replace

import pytest
import torch.distributed as dist

import loom
from loom.config import ConfigError, JobConfig, ModelConfig, parse_args
from loom.plan.command import main as plan_main

TINY = ["--model", "debug", "--n-layers", "1", "--dataset", "random", "--vocab-size", "128",
        "--seq-len", "16", "--fp32", "--max-steps", "1"]


def printed_by_hook(error: BaseException) -> str:
    """What the installed excepthook writes for `error`."""
    err, sys.stderr = sys.stderr, io.StringIO()
    try:
        sys.excepthook(type(error), error, None)
        return sys.stderr.getvalue()
    finally:
        sys.stderr = err


def test_excepthook_is_restored_after_each_fit_and_after_a_failed_one(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)  # whatever tests before did
    hook = sys.excepthook
    for name in ("first", "second"):
        loom.fit([*TINY, "--outdir", str(tmp_path / name)])
        assert sys.excepthook is hook, f"the {name} fit left torch's prefixer installed"
    with pytest.raises(ConfigError, match="missing"):  # fails inside the process group
        loom.fit([*TINY, "--dataset", str(tmp_path / "missing.txt"),
                  "--outdir", str(tmp_path / "bad")])
    assert sys.excepthook is hook and not dist.is_initialized()
    assert "[rank0]" not in printed_by_hook(ValueError("boom"))


def test_loom_plan_in_process_leaves_the_excepthook_too(monkeypatch, capsys):
    """`loom plan` starts a fake process group in the caller's process (tests, `loom.cli`)."""
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    assert plan_main([*TINY, "--world-size", "2", "--device-memory", "80GB"]) == 0
    assert "loom plan:" in capsys.readouterr().out
    assert sys.excepthook is sys.__excepthook__


@pytest.mark.parametrize("config, says", [
    (42, "not int"),
    (b"--lr 1", "not one string"),
    ({"lr": 0.1}, "not dict"),
    (iter(["--lr", "1"]), "not list_iterator"),
    (["--max-steps", 3], "the flags must be strings, got int 3"),
    (JobConfig(model="debug"), "JobConfig.model must be a ModelConfig, got str"),
    (JobConfig(model=ModelConfig(dim="64")), "--dim must be an integer, got str '64'"),
    (JobConfig(model=ModelConfig(dim=True)), "--dim must be an integer, got bool"),
])
def test_a_config_of_the_wrong_type_is_a_config_error(config, says):
    with pytest.raises(ConfigError, match=says.replace("[", r"\[")):
        loom.fit(config)
    assert not dist.is_initialized()


def test_a_job_config_built_in_python_is_validated_before_anything_runs(tmp_path):
    cfg = parse_args([*TINY, "--outdir", str(tmp_path / "run")])
    bad = replace(cfg, optim=replace(cfg.optim, lr=float("nan")))
    with pytest.raises(ConfigError, match="--lr must be a finite number >= 0, got nan"):
        loom.fit(bad)
    assert not (tmp_path / "run").exists()
