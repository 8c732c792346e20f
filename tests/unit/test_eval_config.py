"""Validation flags (bad combinations are one ConfigError line before anything runs) and
where the validation loss shows: the console line and the loss plot."""

from __future__ import annotations

import pytest

from loom.config import ConfigError, parse_args
from loom.plots import PLOTS
from loom.progress import format_progress


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


def test_console_line_and_loss_plot_show_validation():
    row = {"train/iter": 50, "train/loss": 6.5, "train/tps": 1000.0, "train/mfu": 1.0,
           "train/dt": 0.1}
    assert "val" not in format_progress(row, 200, 10.0)
    line = format_progress({**row, "val/loss": 7.25, "val/ppl": 1408.1}, 200, 10.0)
    assert "loss 6.5000  val 7.2500 ppl 1,408.1" in line, line
    assert "val/loss" in PLOTS["loss.png"][1]
