"""`--config run.toml`: file values used unless a flag is given; `--print-config` reads back
equal; a bad file is one ConfigError line."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from loom.cli import config_toml
from loom.config import ConfigError, JobConfig, parse_args
from tests.harness import run_process

RUN_TOML = """\
[model]
model = "debug"
dim = 64

[train]
max_steps = 3
seed = 5

[optim]
lr = 0.01
lr_schedule = "cosine"

[parallel]
dtype = "fp32"
"""


def settings(cfg: JobConfig) -> dict:
    """What a run does; not which of it came from the command line (`explicit`)."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("warnings", "explicit")}


def test_file_values_are_used_except_an_explicit_flag(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(RUN_TOML)
    cfg = parse_args(["--config", str(path), "--lr", "1e-3"])
    assert cfg.optim.lr == 1e-3  # the flag wins
    assert (cfg.model.model, cfg.model.dim, cfg.train.max_steps, cfg.train.seed) == (
        "debug", 64, 3, 5)
    assert (cfg.optim.lr_schedule, cfg.parallel.dtype) == ("cosine", "fp32")
    assert cfg.model.n_layers == 4  # the file's preset still applies under its values


def test_print_config_round_trips(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(RUN_TOML)
    cfg = parse_args(["--config", str(path), "--tp", "2", "--val-fraction", "0.25",
                      "--dataset", "random", "--max-grad-norm", "0.5"])
    printed = tmp_path / "printed.toml"
    printed.write_text(config_toml(cfg))
    again = parse_args(["--config", str(printed)])
    assert settings(again) == settings(cfg), config_toml(again)


def test_print_config_exits_without_training(tmp_path):
    out = run_process([sys.executable, "-m", "loom", "train", "--model", "debug",
                      "--lr", "0.02", "--print-config"], timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[optim]\noptimizer = \"adamw\"\nlr = 0.02\n" in out.stdout
    assert "[model]\nmodel = \"debug\"" in out.stdout


@pytest.mark.parametrize("text, message", [
    ("[optim]\nlr = 'fast'\n", "lr = 'fast' must be float"),
    ("[optim]\nlearning_rate = 1.0\n", "has no setting 'learning_rate'"),
    ("[optimizer]\nlr = 1.0\n", "unknown section [optimizer]"),
    ("[parallel]\nactivation_checkpoint = \"most\"\n", "choose from"),
    ("[train\n", "--config"),
])
def test_bad_files_are_one_line(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(path)])
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
