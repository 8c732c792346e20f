"""A run trained through transformers' module from a weights-only Hugging Face folder (no
tokenizer, as `save_pretrained` writes it): `--save-hf` and `loom export` write a folder
transformers loads, with one warning line and no upstream notice; `--tokenizer-name` ships
that tokenizer; and `loom export` and `loom eval`, which read the source folder again,
refuse a crafted one in one line, exit 2, writing nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loom.commands import eval as eval_command
from loom.hf import export
from tests.harness import REPO
from tests.hf_crafted import CASES, assert_refused
from tests.hf_models import corpus_sample, save_tiny_model, save_tokenizer

transformers = pytest.importorskip("transformers")

NOTICES = ("Failed to load", "_pytree", "Traceback", "Warning")
"""Upstream lines that must stay behind --verbose."""
CONFIG_CASES = [c for c, (_, file, _) in CASES.items() if file == "config.json"]
"""What `loom export` reads of the source folder: its config.json (the weights are the run's)."""

pytestmark = pytest.mark.usefixtures("loom_logger_restored")


def loom(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """A `loom` command in a fresh process, as a user runs it (no --verbose)."""
    return subprocess.run([sys.executable, "-m", "loom", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=600,
                          env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin",
                               "LOOM_CACHE_DIR": str(cwd / "cache")})


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """(source folder, checkpoint, the `loom train --save-hf` process)."""
    root = tmp_path_factory.mktemp("weights-only")
    folder = save_tiny_model(root / "llama", "llama", tokenizer=False)
    proc = loom("train", "--model", str(folder), "--model-impl", "transformers", "--dataset",
                "random", "--max-steps", "1", "--checkpoint-interval", "1", "--seq-len", "16",
                "--fp32", "--save-hf", "--outdir", str(root / "run"), cwd=root)
    assert proc.returncode == 0, proc.stderr
    return folder, root / "run" / "checkpoints" / "step-1", proc


def loads_in_transformers(folder: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, use_safetensors=True)
    assert model.config.vocab_size == 328


def test_save_hf_without_tokenizer_writes_a_loadable_folder_quietly(trained) -> None:
    _, checkpoint, proc = trained
    hf = checkpoint.parent.parent / "hf"
    loads_in_transformers(hf)
    assert not (hf / "tokenizer.json").exists()
    output = proc.stdout + proc.stderr
    assert output.count("cannot be found") == 1, output
    assert not [n for n in NOTICES if n in output], output


def test_export_without_tokenizer_warns_once(trained, tmp_path, capsys) -> None:
    _, checkpoint, _ = trained
    assert export.main([str(checkpoint), str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1 and "cannot be found" in captured.err
    assert "model only: tokenizer" in captured.out
    loads_in_transformers(tmp_path / "out")


def test_export_with_tokenizer_name_ships_it_and_generates_quietly(trained, tmp_path,
                                                                   capsys) -> None:
    _, checkpoint, _ = trained
    save_tokenizer(tmp_path / "tok", corpus_sample(20_000))
    code = export.main([str(checkpoint), str(tmp_path / "out"), "--tokenizer-name",
                        str(tmp_path / "tok")])
    captured = capsys.readouterr()
    assert code == 0 and captured.err == "", captured.err
    shipped = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    original = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert shipped("It is a truth")["input_ids"] == original("It is a truth")["input_ids"]
    loads_in_transformers(tmp_path / "out")
    proc = loom("generate", str(tmp_path / "out"), "--prompt", "It is", "--max-new-tokens",
                "4", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.startswith("It is"), proc.stdout


@pytest.fixture
def source(trained):
    """The run's source folder, restored after a test crafts it."""
    folder = trained[0]
    keep = folder.parent / "pristine"
    shutil.copytree(folder, keep)
    yield folder
    shutil.rmtree(folder)
    keep.rename(folder)


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_export_refuses_a_crafted_source_folder(trained, source, tmp_path, capsys,
                                                case) -> None:
    CASES[case][0](source)
    code = export.main([str(trained[1]), str(tmp_path / "out")])
    grown = "describe" if CASES[case][2] == "the safetensors hold" else None  # vs the run's
    assert_refused(code, capsys.readouterr().err, source, case, grown)
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", list(CASES))
def test_eval_refuses_a_crafted_source_folder(trained, source, capsys, case) -> None:
    CASES[case][0](source)
    checkpoint = trained[1]
    code = eval_command.main([str(checkpoint), "--model", str(source), "--model-impl",
                              "transformers", "--dataset", "random", "--seq-len", "16"])
    assert_refused(code, capsys.readouterr().err, source, case)
    assert not (checkpoint.parent.parent / f"eval-{checkpoint.name}").exists()
