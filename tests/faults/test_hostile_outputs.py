"""Where `loom export`, `--save-hf` and `loom eval` write: every folder is checked before
any work (a link, a file, a FIFO, a non-empty folder without --overwrite, the run,
checkpoint or base model the command reads) and refused in one line, exit 2, with nothing
created or changed; `--overwrite` replaces an export whole, so no file of the old one
survives and `from_pretrained` loads the new weights."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from loom.cli import run_train
from loom.commands.eval import main as eval_main
from loom.commands.eval_outputs import eval_folder
from loom.hf.export import main as export_main
from loom.hf.run_checkpoint import load_run_model
from loom.safe_io import write_text_new
from tests.faults.test_checkpoint_trust import TINY, loom

pytestmark = pytest.mark.usefixtures("loom_logger_restored")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run folder with checkpoints step-1 and step-2 (different weights)."""
    outdir = tmp_path_factory.mktemp("outputs") / "run"
    proc = loom("train", *TINY, "--max-steps", "2", "--checkpoint-interval", "1",
                "--outdir", str(outdir))
    assert proc.returncode == 0, proc.stderr
    return outdir


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under `root` (links not followed): kind, size, mtime and link target."""
    seen = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            st = os.lstat(path)
            seen[str(path.relative_to(root))] = (
                st.st_mode, st.st_size if not path.is_dir() else 0, st.st_mtime_ns,
                os.readlink(path) if path.is_symlink() else None)
    return seen


def one_error_line(code: int, err: str, *needles: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


Setup = Callable[[Path, Path], tuple[list[str], str]]
"""(tmp_path, run) -> (the command's arguments after the checkpoint, text the line names)."""


def make_link(tmp: Path, run: Path) -> tuple[list[str], str]:
    (tmp / "elsewhere").mkdir()
    (tmp / "out").symlink_to(tmp / "elsewhere")
    return [str(tmp / "out")], "is a symbolic link"


def make_file(tmp: Path, run: Path) -> tuple[list[str], str]:
    (tmp / "out").write_text("keep")
    return [str(tmp / "out"), "--overwrite"], "is a file, not a folder"


def make_fifo(tmp: Path, run: Path) -> tuple[list[str], str]:
    os.mkfifo(tmp / "out")
    return [str(tmp / "out")], "is a FIFO, not a folder"


def make_older_export(tmp: Path, run: Path) -> tuple[list[str], str]:
    (tmp / "out").mkdir()
    (tmp / "out" / "model.safetensors").write_bytes(b"old")
    return [str(tmp / "out")], "is not empty (it holds model.safetensors); pass --overwrite"


def make_other_run(tmp: Path, run: Path) -> tuple[list[str], str]:
    (tmp / "other").mkdir()
    (tmp / "other" / ".loom-run").write_text("a run")
    (tmp / "other" / "config.json").write_text("{}")
    return [str(tmp / "other"), "--overwrite"], "holds a loom run"


def make_base_folder(tmp: Path, run: Path) -> tuple[list[str], str]:
    """The run's config names a local model folder (a LoRA run's base): never replaced."""
    (tmp / "base").mkdir()
    (tmp / "base" / "config.json").write_text("{}")
    config = json.loads((run / "config.json").read_text())
    config["model"]["model"] = str(tmp / "base")
    (run / "config.json").write_text(json.dumps(config))
    return [str(tmp / "base"), "--overwrite"], "which this command reads"


EXPORT_CASES: dict[str, Setup] = {
    "link": make_link,
    "file": make_file,
    "fifo": make_fifo,
    "older-export": make_older_export,
    "another-run": make_other_run,
    "base-model": make_base_folder,
    "the-checkpoint": lambda tmp, run: ([str(run / "checkpoints" / "step-2"), "--overwrite"],
                                        "which this command reads"),
    "the-run-folder": lambda tmp, run: ([str(run), "--overwrite"], "which this command reads"),
    "above-the-run": lambda tmp, run: ([str(tmp), "--overwrite"], "which this command reads"),
    "inside-checkpoints": lambda tmp, run: ([str(run / "checkpoints" / "x")], "is inside"),
    "shard-size-word": lambda tmp, run: ([str(tmp / "out"), "--max-shard-bytes", "big"],
                                         "--max-shard-bytes: invalid int value"),
    "shard-size-0": lambda tmp, run: ([str(tmp / "out"), "--max-shard-bytes", "0"],
                                      "--max-shard-bytes must be >= 1"),
}


def export(argv: list[str]) -> int:
    """`loom export` in this process; argparse's own usage errors exit (SystemExit)."""
    try:
        return export_main(argv)
    except SystemExit as e:
        return int(e.code or 0)


@pytest.mark.parametrize("case", list(EXPORT_CASES))
def test_export_refuses_a_bad_folder_in_one_line(run: Path, tmp_path: Path, capsys,
                                                 case: str) -> None:
    copy = Path(shutil.copytree(run, tmp_path / "run", symlinks=True))
    args, message = EXPORT_CASES[case](tmp_path, copy)
    before = snapshot(tmp_path)
    code = export([str(copy / "checkpoints" / "step-2"), *args])
    one_error_line(code, capsys.readouterr().err, message)
    assert snapshot(tmp_path) == before  # no .partial, nothing written or replaced


def test_export_with_dot_in_the_run_folder_is_refused(run: Path, tmp_path: Path, capsys,
                                                      monkeypatch) -> None:
    copy = Path(shutil.copytree(run, tmp_path / "run"))
    monkeypatch.chdir(copy)
    before = snapshot(tmp_path)
    code = export(["checkpoints/step-2", ".", "--overwrite"])
    one_error_line(code, capsys.readouterr().err, "which this command reads")
    assert snapshot(tmp_path) == before


TOKENS = torch.randint(64, (2, 12), generator=torch.Generator().manual_seed(0))


def loom_logits(checkpoint: Path) -> torch.Tensor:
    model, _ = load_run_model(checkpoint)
    with torch.no_grad():
        return model.eval()(TOKENS)


def test_overwrite_replaces_an_older_export_whole(run: Path, tmp_path: Path, capsys) -> None:
    """The issue's case: the old single-file export must not survive beside new shards."""
    transformers = pytest.importorskip("transformers")
    out, step1, step2 = tmp_path / "out", *(run / "checkpoints" / f"step-{n}" for n in (1, 2))
    assert export([str(step1), str(out)]) == 0
    assert (out / "model.safetensors").is_file()
    old = snapshot(out)
    capsys.readouterr()
    code = export([str(step2), str(out), "--max-shard-bytes", "20000"])
    one_error_line(code, capsys.readouterr().err, "is not empty", "--overwrite")
    assert snapshot(out) == old

    assert export([str(step2), str(out), "--max-shard-bytes", "20000",
                        "--overwrite"]) == 0
    assert export([str(step2), str(tmp_path / "fresh"), "--max-shard-bytes",
                        "20000"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "fresh").iterdir())
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    assert not list(tmp_path.glob(".out.*"))  # neither the staging folder nor the old one
    exported = transformers.AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        got = exported.eval()(input_ids=TOKENS).logits
    want, stale = loom_logits(step2), loom_logits(step1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (stale - want).abs().max() > 1e-3, "step-1 and step-2 must differ for this test"


RUN_ENTRIES = {"--save-hf": "hf", "--profile": "profile", "--tensorboard": "tensorboard"}


@pytest.mark.parametrize("kind", ["link", "file"])
@pytest.mark.parametrize("flag", list(RUN_ENTRIES))
def test_a_run_entry_that_is_a_link_or_file_is_refused_before_training(
        tmp_path: Path, capsys, flag: str, kind: str) -> None:
    outdir = tmp_path / "run"
    outdir.mkdir()
    entry = outdir / RUN_ENTRIES[flag]
    if kind == "link":
        (tmp_path / "elsewhere").mkdir()
        entry.symlink_to(tmp_path / "elsewhere")
    else:
        entry.write_text("keep")
    before = snapshot(tmp_path)
    code = run_train([*TINY, "--max-steps", "1", "--checkpoint-interval", "1", flag,
                      "--outdir", str(outdir)])
    one_error_line(code, capsys.readouterr().err, f"{flag} folder",
                   "is a symbolic link" if kind == "link" else "is a file, not a folder")
    assert snapshot(tmp_path) == before


EVAL_CASES: dict[str, Setup] = {
    "copied-step-folder": lambda tmp, run: ([], "is not inside a run folder"),
    "outdir-the-run": lambda tmp, run: (["--outdir", str(run)], "which this command reads"),
    "outdir-in-checkpoints": lambda tmp, run: (["--outdir", str(run / "checkpoints" / "x")],
                                               "is inside"),
    "outdir-file": lambda tmp, run: (["--outdir", str(run / "config.json")], "is a file"),
}


def eval_link(tmp: Path, run: Path, name: str) -> tuple[list[str], str]:
    (tmp / "elsewhere").mkdir()
    (run / name).symlink_to(tmp / "elsewhere")
    return [], "is a symbolic link"


@pytest.mark.parametrize("mode", ["loss", "tasks"])
@pytest.mark.parametrize("case", [*EVAL_CASES, "results-link"])
def test_eval_refuses_a_bad_results_folder_in_one_line(run: Path, tmp_path: Path, capsys,
                                                       case: str, mode: str) -> None:
    copy = Path(shutil.copytree(run, tmp_path / "run"))
    checkpoint = copy / "checkpoints" / "step-2"
    if case == "copied-step-folder":
        checkpoint = Path(shutil.copytree(checkpoint, tmp_path / "step-2"))
    if case == "results-link":
        args, message = eval_link(tmp_path, copy, "eval" if mode == "tasks" else "eval-step-2")
    else:
        args, message = EVAL_CASES[case](tmp_path, copy)
    flags = ["--tasks", "anything"] if mode == "tasks" else ["--dataset", "random"]
    before = snapshot(tmp_path)
    code = eval_main([str(checkpoint), *flags, *args])
    one_error_line(code, capsys.readouterr().err, message)
    assert snapshot(tmp_path) == before


def test_eval_folder_is_the_resolved_run_s(run: Path, tmp_path: Path, monkeypatch) -> None:
    """A linked checkpoint, or `.` inside it, names its own run folder, never the link's
    folder or the working directory."""
    (tmp_path / "links").mkdir()
    link = tmp_path / "links" / "step-2"
    link.symlink_to(run / "checkpoints" / "step-2")
    assert eval_folder(link, None, "eval") == run.resolve() / "eval"
    monkeypatch.chdir(run / "checkpoints" / "step-2")
    assert eval_folder(Path("."), None, "eval-step-2") == run.resolve() / "eval-step-2"


def test_results_files_never_replace_an_earlier_one(tmp_path: Path) -> None:
    first = write_text_new(tmp_path / "tasks-step-2.json", "first")
    (tmp_path / "tasks-step-2.1.json").symlink_to(tmp_path / "target")
    second = write_text_new(tmp_path / "tasks-step-2.json", "second")
    assert first.read_text() == "first" and second.name == "tasks-step-2.2.json"
    assert second.read_text() == "second" and not (tmp_path / "target").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "tasks-step-2.1.json", "tasks-step-2.2.json", "tasks-step-2.json"]


def test_peft_export_is_quiet_and_never_replaces_the_base(tmp_path: Path, capsys) -> None:
    """A LoRA run trained from a local folder: its --peft export prints the result line and
    nothing else (upstream notices need --verbose), and the base folder is never an
    export folder, --overwrite or not."""
    pytest.importorskip("peft")
    from tests.hf_models import save_tiny_model

    base = save_tiny_model(tmp_path / "base", "llama")
    proc = loom("train", "--model", str(base), "--dataset", "random", "--seq-len", "16",
                "--fp32", "--max-steps", "1", "--lora-rank", "2", "--checkpoint-interval",
                "1", "--outdir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    step = str(tmp_path / "run" / "checkpoints" / "step-1")
    proc = loom("export", step, str(tmp_path / "adapter"), "--peft")  # a real stderr
    assert proc.returncode == 0 and "PEFT LoRA adapter" in proc.stdout, proc.stderr
    assert proc.stderr == "", proc.stderr
    capsys.readouterr()  # saving the base folder's progress bar
    before = snapshot(tmp_path)
    for target in (base, tmp_path / "adapter"):
        code = export([step, str(target), "--peft"])
        one_error_line(code, capsys.readouterr().err, str(target))
    code = export([step, str(base), "--peft", "--overwrite"])
    one_error_line(code, capsys.readouterr().err, "which this command reads")
    assert snapshot(tmp_path) == before


def tokenize_out_link(tmp: Path) -> str:
    (tmp / "elsewhere").mkdir()
    (tmp / "out").symlink_to(tmp / "elsewhere")
    return "is a symbolic link"


def tokenize_out_file(tmp: Path) -> str:
    (tmp / "out").write_text("keep")
    return "is a file, not a folder"


def tokenize_out_stranger(tmp: Path) -> str:
    (tmp / "out").mkdir()
    (tmp / "out" / "notes.txt").write_text("mine")
    return "is not empty (it holds notes.txt)"


def tokenize_link_inside(tmp: Path) -> str:
    (tmp / "out" / ".parts").mkdir(parents=True)
    (tmp / "out" / ".parts" / "plan.json").symlink_to(tmp / "elsewhere.json")
    return ".parts/plan.json is a symbolic link"


@pytest.mark.parametrize("setup", [tokenize_out_link, tokenize_out_file, tokenize_out_stranger,
                                   tokenize_link_inside], ids=lambda f: f.__name__)
def test_tokenize_refuses_a_bad_out_folder_in_one_line(tmp_path: Path, capsys, setup) -> None:
    from loom.commands.tokenize import main as tokenize_main

    (tmp_path / "corpus.txt").write_text("a few words to tokenize\n" * 20)
    message = setup(tmp_path)
    before = snapshot(tmp_path)
    code = tokenize_main([str(tmp_path / "corpus.txt"), str(tmp_path / "out"), "-j", "1"])
    one_error_line(code, capsys.readouterr().err, "loom tokenize OUT", message)
    assert snapshot(tmp_path) == before


def test_a_failed_start_leaves_no_outputs_folder(tmp_path: Path, capsys, monkeypatch) -> None:
    """Without --outdir the run folder is outputs/<time>; a start that fails (here a
    --resume with no checkpoint) removes it and the outputs/ it made."""
    monkeypatch.chdir(tmp_path)
    code = run_train([*TINY, "--max-steps", "1", "--resume", str(tmp_path / "nothing")])
    one_error_line(code, capsys.readouterr().err, "--resume")
    assert list(tmp_path.iterdir()) == []


def test_a_second_eval_never_replaces_the_first(run: Path, tmp_path: Path, capsys) -> None:
    copy = Path(shutil.copytree(run, tmp_path / "run"))
    checkpoint = str(copy / "checkpoints" / "step-2")
    flags = ["--dataset", "random", "--seq-len", "16", "--eval-steps", "1"]
    assert eval_main([checkpoint, *flags]) == 0
    first = (copy / "eval-step-2" / "eval.json").read_text()
    assert eval_main([checkpoint, *flags, "--batch-size", "2"]) == 0
    assert (copy / "eval-step-2" / "eval.json").read_text() == first
    second = json.loads((copy / "eval-step-2" / "eval.1.json").read_text())
    assert second["checkpoint"] == checkpoint and "val/loss" in second
    assert "eval.1.json" in capsys.readouterr().out
