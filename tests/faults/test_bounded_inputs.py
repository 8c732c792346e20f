"""Numbers read from a Hugging Face folder's config.json or a flag's values, and the files
loom parses (tokenizer.json, a TOML config), are checked against declared bounds before
anything divides, raises to a power or allocates by them: each case is exit 2, one
`error:` line naming the field, no traceback, and nothing written (issue #68, item 6)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from loom.cli import run_train, subcommand
from tests.faults.test_hostile_outputs import snapshot

pytestmark = pytest.mark.usefixtures("loom_logger_restored")
TRAIN = ["--model", "debug", "--dim", "32", "--n-layers", "1", "--n-heads", "2",
         "--n-kv-heads", "1", "--seq-len", "16", "--fp32", "--seed", "3", "--max-steps", "1"]
RANDOM = ["--dataset", "random", "--vocab-size", "64"]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> Path:
    from tests.deepseek_folders import save_deepseek

    return save_deepseek(tmp_path_factory.mktemp("ds") / "ds", tokenizer=False)


def edited(folder: Path, to: Path, rope: dict) -> str:
    """A copy of the DeepSeek-V3 folder with `rope` merged into its rope_parameters."""
    shutil.copytree(folder, to)
    config = json.loads((to / "config.json").read_text())
    config["rope_parameters"].update(rope)
    (to / "config.json").write_text(json.dumps(config))
    return str(to)


def tokenizer_folder(to: Path, text: str) -> str:
    to.mkdir()
    (to / "tokenizer.json").write_text(text)
    return str(to)


def toml(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def val_sets(folder: Path, count: int) -> list[str]:
    (folder / "v.txt").write_text("validation text\n")
    return [arg for i in range(count) for arg in ("--val-dataset", f"v{i}={folder}/v.txt")]


Case = Callable[[Path, Path], tuple[str, list[str], str]]
"""(inputs folder, DeepSeek-V3 folder) -> (command, its arguments, what the line names)."""
DEEP = "[" * 100_000 + "]" * 100_000
CASES: dict[str, Case] = {
    **{f"{cmd}-yarn-{name}": (lambda t, ds, cmd=cmd, name=name, value=value: (
        cmd, ["--model", edited(ds, t / "ds", {name: value}),
              *(["--world-size", "1", "--device-memory", "1GiB"] if cmd == "plan" else
                ["--dataset", "random", "--seq-len", "16", "--max-steps", "1"])],
        f"config.json: rope_parameters.{name} must be"))
       for cmd in ("train", "plan")
       for name, value in (("beta_fast", 0), ("beta_slow", 0), ("rope_theta", 1),
                           ("mscale_all_dim", 1e300), ("factor", 1e9))},
    "muon-coefficient-huge": lambda t, ds: (
        "train", [*RANDOM, "--optimizer", "muon", "--muon-ns-coefficients", "1e308,1,1"],
        "--muon-ns-coefficients a must be <= 1000"),
    **{f"{cmd}-tokenizer-{name}": (lambda t, ds, cmd=cmd, text=text, needle=needle: (
        cmd, ["--tokenizer-name", tokenizer_folder(t / "tok", text),
              *([str(t / "doc.txt"), str(t / "tokens")] if cmd == "tokenize" else
                ["--dataset", str(t / "doc.txt")])], needle))
       for cmd in ("train", "tokenize")
       for name, text, needle in (
           ("nested", DEEP, "tokenizer.json is unreadable (tokenizer.json nests too deeply)"),
           ("other-schema", '{"model": 5}', "tokenizer.json has no `model` object"),
           ("no-added-tokens", '{"model": {}}', "has no `added_tokens` list"),
           ("bad-model", '{"model": {}, "added_tokens": []}', "cannot load it"))},
    "val-dataset-300": lambda t, ds: (
        "train", [*RANDOM, *val_sets(t, 300)], "--val-dataset may be given at most 32 times"),
    "toml-outdir-nested": lambda t, ds: (
        "train", [*RANDOM, "--config", toml(t / "c.toml", f"[output]\noutdir = {DEEP[:6000]}\n")],
        "nests arrays or tables too deeply"),
    "toml-outdir-nul": lambda t, ds: (
        "train", [*RANDOM, "--config", toml(t / "c.toml", '[output]\noutdir = "a\\u0000b"\n')],
        "--outdir must not hold a NUL byte"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_out_of_range_number_or_unbounded_file_is_one_line(
        tmp_path: Path, capsys, deepseek: Path, case: str, monkeypatch) -> None:
    inputs, run = tmp_path / "in", tmp_path / "work"
    inputs.mkdir()
    run.mkdir()
    monkeypatch.chdir(run)  # a run folder or tokens would land here
    (inputs / "doc.txt").write_text("some text to train on\n" * 20)
    command, args, needle = CASES[case](inputs, deepseek)
    before = snapshot(inputs)
    if command == "train":  # a --config's outdir is its own (the flag would win)
        outdir = [] if "--config" in args else ["--outdir", str(run / "out")]
        code = run_train([*TRAIN, *args, *outdir] if "--model" not in args else
                         [*args, *outdir])
    else:
        code = subcommand(command)(args)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert code == 2 and errors == [errors[0]] and needle in errors[0], (code, err)
    assert "Traceback" not in err and len(err.splitlines()) <= 4, err
    assert snapshot(inputs) == before and list(run.iterdir()) == []  # a run folder: removed
