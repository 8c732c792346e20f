"""Validation flags: bad combinations are one ConfigError line before anything runs."""

from __future__ import annotations

import pytest

from loom.config import ConfigError, parse_args


@pytest.mark.parametrize("flags, message", [
    (["--val-fraction", "1.0"], "--val-fraction must be in [0, 1)"),
    (["--val-fraction", "0.1", "--val-dataset", "x.jsonl"], "exclude each other"),
    (["--eval-every", "10"], "--eval-every needs validation data"),
    (["--val-fraction", "0.1", "--eval-steps", "0"], "--eval-steps >= 1"),
    (["--dataset", "random", "--val-dataset", "x.jsonl"], "needs a text --dataset"),
])
def test_bad_validation_flags(flags, message):
    with pytest.raises(ConfigError) as info:
        parse_args(["--model", "debug", *flags])
    assert message in str(info.value), str(info.value)


def test_validation_flags_parse():
    cfg = parse_args(["--val-fraction", "0.05", "--eval-every", "50", "--eval-steps", "4"])
    assert (cfg.eval.val_fraction, cfg.eval.eval_every, cfg.eval.eval_steps) == (0.05, 50, 4)
