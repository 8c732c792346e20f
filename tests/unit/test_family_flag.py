"""A family registered outside src/ declares a flag of its own (issue #56): the GPT-2 test
family's `--gpt2-activation gelu|relu` is in `loom train --help`, a `[model]` TOML table and
`--print-config`, is validated, and is recorded in and restored from its checkpoints, with
nothing under src/ written for it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import loom
import tests.families.gpt2  # registers gpt2-test and its flag
from loom.checkpoint.model_record import rebuilt_args
from loom.cli import config_toml
from loom.commands.eval import eval_argv, eval_settings
from loom.config import ConfigError, JobConfig, build_parser, parse_args, validate
from loom.config.resolved import settled
from tests.families.gpt2 import GPT2Flags


def eval_config(checkpoint: Path, argv: list[str]) -> JobConfig:
    """`loom eval`'s config for `checkpoint` and `argv`, settled as `run_eval` settles it."""
    flags = parse_args(eval_argv(checkpoint, argv))
    return settled(flags, **eval_settings(checkpoint, flags))

FAMILY = ["--family", "gpt2-test", "--dim", "32", "--n-layers", "2", "--n-heads", "4",
          "--vocab-size", "64", "--max-seq-len", "16", "--seq-len", "16", "--dataset",
          "random", "--fp32", "--seed", "1"]


def test_the_flag_is_in_help_toml_and_print_config(tmp_path):
    help_text = build_parser().format_help()
    assert "model: GPT-2 (test family):" in help_text
    assert "--gpt2-activation {gelu,relu}" in help_text
    cfg = parse_args([*FAMILY, "--gpt2-activation", "relu"])
    assert cfg.model.flags_of(GPT2Flags).gpt2_activation == "relu"
    assert 'gpt2_activation = "relu"' in config_toml(cfg).split("[parallel]")[0]
    path = tmp_path / "run.toml"
    path.write_text('[model]\nfamily = "gpt2-test"\ngpt2_activation = "relu"\n')
    from_file = parse_args(["--config", str(path), "--dataset", "random"])
    assert from_file.model.flags_of(GPT2Flags).gpt2_activation == "relu"


def test_the_flag_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="invalid choice: 'tanh'"):
        parse_args([*FAMILY, "--gpt2-activation", "tanh"])
    path = tmp_path / "run.toml"
    path.write_text('[model]\ngpt2_activation = "tanh"\n')
    with pytest.raises(ConfigError, match="gpt2_activation = 'tanh'; choose from gelu, relu"):
        parse_args(["--config", str(path), "--dataset", "random"])
    cfg = parse_args(FAMILY)
    built = replace(cfg, model=cfg.model.with_values(gpt2_activation="tanh"))  # from Python
    with pytest.raises(ConfigError, match="--gpt2-activation 'tanh': choose gelu or relu"):
        validate(built)


def test_the_flag_changes_the_model_and_is_restored_from_the_checkpoint(tmp_path, process_group,
                                                                        loom_logger_restored):
    """A relu run's checkpoint records relu; `loom eval` takes it from the checkpoint (no
    flag given) and the record rebuilds a model that computes as the relu run's did."""
    runs = {}
    for act in ("gelu", "relu"):
        runs[act] = loom.fit([*FAMILY, "--gpt2-activation", act, "--max-steps", "2",
                              "--checkpoint-interval", "2", "--outdir", str(tmp_path / act)])
    assert runs["gelu"].losses[1] != runs["relu"].losses[1]  # same weights, other function
    step = tmp_path / "relu" / "checkpoints" / "step-2"
    loop = json.loads((step / "loop.json").read_text())
    assert loop["model_args"]["gpt2_activation"] == "relu"
    assert loop["architecture"]["gpt2_activation"] == "relu"
    args = rebuilt_args(loop["architecture"])
    assert args.gpt2_activation == "relu"
    x = torch.linspace(-2, 2, 9)
    torch.testing.assert_close(tests.families.gpt2.ACTIVATIONS[args.gpt2_activation](x),
                               torch.relu(x))
    cfg = eval_config(step, ["--dataset", "random"])
    assert cfg.model.flags_of(GPT2Flags).gpt2_activation == "relu"
