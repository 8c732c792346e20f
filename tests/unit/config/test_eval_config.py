"""Validation flags (bad combinations are one ConfigError line before anything runs; named
sets and their keys; `loom eval`'s whole-set default) and where the validation loss shows:
the console line and the loss plot, one curve per set."""

from __future__ import annotations

from pathlib import Path

import pytest

from loom.commands.eval import eval_argv, eval_settings
from loom.config import ConfigError, JobConfig, parse_args
from loom.config.file import read_config_file, to_toml
from loom.config.job import SECTIONS, section_fields, section_values
from loom.config.resolved import settled
from loom.config.valsets import split_val_dataset, val_prefix, val_sets
from loom.observability.plots import plot_series
from loom.observability.progress import format_progress


def eval_config(checkpoint: Path, argv: list[str]) -> JobConfig:
    """`loom eval`'s config for `checkpoint` and `argv`, settled as `run_eval` settles it."""
    flags = parse_args(eval_argv(checkpoint, argv))
    return settled(flags, **eval_settings(checkpoint, flags))


@pytest.mark.parametrize("flags, message", [
    (["--val-fraction", "1.0"], "--val-fraction must be < 1, got 1.0"),
    (["--val-fraction", "0.1", "--val-dataset", "x.jsonl"], "exclude each other"),
    (["--eval-every", "10"], "--eval-every needs validation data"),
    (["--val-fraction", "0.1", "--eval-steps", "-1"], "--eval-steps must be >= 0"),
    (["--dataset", "random", "--val-dataset", "x.jsonl"], "needs a text --dataset"),
    (["--val-dataset", "a=x.txt", "--val-dataset", "a=y.txt"], "two sets with the name 'a'"),
    (["--val-dataset", "x.txt", "--val-dataset", "y.txt"], "two sets with no name"),
    (["--val-dataset", "code="], "no path after 'code='"),
    (["--eval-tasks-every", "10"], "need --eval-tasks"),
    (["--eval-tasks-include", "tasks/"], "need --eval-tasks"),
    (["--eval-tasks", "t", "--eval-tasks-limit", "-1"], "--eval-tasks-limit must be >= 0"),
    (["--eval-tasks", "t", "--pp", "2", "--n-layers", "2"], "not with --pp or --cp"),
])
def test_bad_validation_flags(flags, message):
    with pytest.raises(ConfigError) as info:
        parse_args(["--model", "debug", *flags])
    assert message in str(info.value), str(info.value)


def test_validation_flags_parse():
    cfg = parse_args(["--val-fraction", "0.05", "--eval-every", "50", "--eval-steps", "4"])
    assert (cfg.eval.val_fraction, cfg.eval.eval_every, cfg.eval.eval_steps) == (0.05, 50, 4)
    assert cfg.eval.val_dataset == ()


def test_val_dataset_repeats_and_names_its_sets():
    cfg = parse_args(["--val-fraction", "0.1", "--val-dataset", "code=data/code.jsonl",
                      "--val-dataset", "web=hub/owner/name"])
    assert cfg.eval.val_dataset == ("code=data/code.jsonl", "web=hub/owner/name")
    assert val_sets(cfg.eval) == {"code": "data/code.jsonl", "web": "hub/owner/name"}
    one = parse_args(["--val-dataset", "held.txt"])
    assert val_sets(one.eval) == {"": "held.txt"}  # the default set: val/loss as before
    assert [val_prefix(n) for n in ("", "code")] == ["val/", "val/code/"]


@pytest.mark.parametrize("value, parsed", [
    ("a=b/c.txt", ("a", "b/c.txt")), ("my-set.2=x=y.txt", ("my-set.2", "x=y.txt")),
    ("dir/a=b.txt", ("", "dir/a=b.txt")), ("owner/name", ("", "owner/name")),
    ("=x.txt", ("", "=x.txt"))])
def test_a_set_name_is_one_key_segment_before_the_first_equals(value, parsed):
    assert split_val_dataset(value) == parsed


def test_named_sets_round_trip_through_a_config_file(tmp_path: Path):
    cfg = parse_args(["--val-dataset", "a=x.txt", "--val-dataset", "y.txt"])
    path = tmp_path / "run.toml"
    path.write_text(to_toml({name: section_values(cfg, name) for name in SECTIONS}))
    tables = {name: section_fields(name) for name in SECTIONS}
    assert read_config_file(str(path), tables)["val_dataset"] == ("a=x.txt", "y.txt")
    path.write_text('[eval]\nval_dataset = ["a=x.txt", 3]\n')
    with pytest.raises(ConfigError, match="must be a list of str"):
        read_config_file(str(path), tables)


def checkpoint_folder(root: Path) -> Path:
    """A folder `eval_config` takes for a checkpoint (its loop.json is read by the stand-in
    for `read_loop`)."""
    step = root / "run" / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    (step / "loop.json").write_text("{}")
    return step


def test_loom_eval_scores_the_whole_set_unless_eval_steps_limits_it(tmp_path, monkeypatch):
    monkeypatch.setattr("loom.commands.eval.read_loop",
                        lambda path: {"model_args": {"dim": 64}, "architecture": {},
                                      "param_groups": [{}]})
    step = checkpoint_folder(tmp_path)
    assert eval_config(step, ["--dataset", "x.txt"]).eval.eval_steps == 0  # 0: every window
    assert eval_config(step, ["--dataset", "x.txt", "--eval-steps", "3"]).eval.eval_steps == 3
    assert parse_args([]).eval.eval_steps == 8  # training's validation keeps its default


def test_console_line_and_loss_plot_show_every_validation_set():
    row = {"train/iter": 50, "train/loss": 6.5, "train/tps": 1000.0, "train/mfu": 1.0,
           "train/dt": 0.1, "train/tokens_seen": 100}
    assert "val" not in format_progress(row, 200, 10.0)
    line = format_progress({**row, "val/loss": 7.25, "val/ppl": 1408.1}, 200, 10.0)
    assert "loss 6.5000  val 7.2500 ppl 1,408.1" in line, line
    named = format_progress({**row, "val/code/loss": 5.5, "val/web/loss": 6.25}, 200, 10.0)
    assert "val/code 5.5000  val/web 6.2500" in named, named
    rows = [{**row, "train/iter": 1, "train/tokens_seen": 10},
            {**row, "train/iter": 2, "train/tokens_seen": 20, "val/loss": 7.0,
             "val/code/loss": 5.0, "val/web/loss": 6.0}]
    loss = plot_series(rows)["loss.png"]
    assert loss == {"train/loss": [(10, 6.5), (20, 6.5)], "val/loss": [(20, 7.0)],
                    "val/code/loss": [(20, 5.0)], "val/web/loss": [(20, 6.0)]}
