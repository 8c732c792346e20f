"""A family's arguments are a function of the resolved config alone (issue #67): its sizes
were settled when the run was resolved (a preset's row, a Hugging Face folder's config.json
read once by `model_choice`), so `args_from_config` opens no file, however often it runs."""

from __future__ import annotations

import builtins
import io
import os
from pathlib import Path

import pytest

from loom.config import parse_args
from loom.config.presets import PRESETS
from loom.models.registry import for_config
from loom.models.resolve import model_args
from loom.trainer.resolve import resolve_model
from tests.deepseek_folders import YARN, save_deepseek


def refuse_file_access(monkeypatch) -> list[str]:
    """Every way of reading a file raises (and is recorded), until the test ends."""
    calls: list[str] = []

    def refused(name):
        def call(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} called while building arguments")
        return call

    for owner, name in ((builtins, "open"), (io, "open"), (os, "open"), (os, "stat"),
                        (os, "listdir"), (os, "scandir"), (Path, "read_text"),
                        (Path, "read_bytes"), (Path, "open"), (Path, "is_dir"),
                        (Path, "exists")):
        monkeypatch.setattr(owner, name, refused(f"{getattr(owner, '__name__', owner)}.{name}"))
    return calls


def test_the_file_guard_sees_a_read(monkeypatch, tmp_path) -> None:
    target = tmp_path / "x"
    target.write_text("1")
    calls = refuse_file_access(monkeypatch)
    with pytest.raises(AssertionError):
        target.read_text()
    with pytest.raises(AssertionError):
        open(target)  # noqa: SIM115
    assert calls == ["Path.read_text", "builtins.open"]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_preset_s_arguments_read_no_file(monkeypatch, preset: str) -> None:
    cfg = parse_args(["--model", preset, "--dataset", "random"])
    expected = model_args(cfg)
    refuse_file_access(monkeypatch)
    assert for_config(cfg.model).args_from_config(cfg.model) == expected


def test_a_hub_folder_s_shape_is_read_once_then_held_by_the_config(monkeypatch,
                                                                     tmp_path) -> None:
    """The folder's MLA widths and YaRN settings are in the resolved config (config.json
    records them); building the arguments again reads nothing."""
    folder = save_deepseek(tmp_path / "ds", tokenizer=False)
    cfg = resolve_model(parse_args(["--model", str(folder), "--dataset", "random",
                                    "--seq-len", "32"]))
    values = cfg.model.values()
    assert (values["kv_lora_rank"], values["q_lora_rank"], values["yarn_factor"]) == \
        (16, 16, YARN["factor"])
    expected = model_args(cfg)
    refuse_file_access(monkeypatch)
    args = for_config(cfg.model).args_from_config(cfg.model)
    assert args == expected and args.yarn_mscale == YARN["mscale"]


def test_a_width_the_user_sets_wins_over_the_folder_s(tmp_path) -> None:
    folder = save_deepseek(tmp_path / "ds", tokenizer=False)
    cfg = resolve_model(parse_args(["--model", str(folder), "--dataset", "random",
                                    "--seq-len", "32", "--n-group", "1"]))
    assert model_args(cfg).n_group == 1
