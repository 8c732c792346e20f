"""Hugging Face folders are hostile input: each crafted folder below (built here from a tiny
`save_pretrained` one) makes `loom train`, `loom plan` and `loom generate` answer with one
`error:` line naming the file and the field, exit 2, no traceback and nothing written; the
checked reader itself accepts the real folder and what transformers writes."""

from __future__ import annotations

import json
import logging
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loom import generate
from loom.cli import run_train
from loom.models.hf_folder import open_folder
from loom.plan import command as plan
from tests.hf_models import save_tiny_model

pytest.importorskip("transformers")


def edit_config(**changes: object) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))
    return edit


def edit_header(change: Callable[[dict], None]) -> Callable[[Path], None]:
    """Rewrite model.safetensors' header (the data bytes kept) after `change` edits it."""
    def edit(folder: Path) -> None:
        path = folder / "model.safetensors"
        raw = path.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + length])
        change(header)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])
    return edit


def first_tensor(header: dict) -> dict:
    return header[min(k for k in header if k != "__metadata__")]


def past_end(header: dict) -> None:
    first_tensor(header)["data_offsets"][1] += 10**9


def shape_mismatch(header: dict) -> None:
    first_tensor(header)["shape"] = [1, 1]


def unknown_dtype(header: dict) -> None:
    first_tensor(header)["dtype"] = "Q7"


def absurd_length(folder: Path) -> None:
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**62) + raw[8:])


def deep_nesting(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    text = json.dumps(config)[:-1] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}"
    (folder / "config.json").write_text(text)


def pickled_only(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(2)}, folder / "pytorch_model.bin")


def index_outside(folder: Path) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "../model.safetensors"}}))
    (folder / "model.safetensors").unlink()


CASES = {  # id: (how the folder is crafted, file named, words of the field)
    "offsets-past-end": (edit_header(past_end), "model.safetensors", "data_offsets"),
    "shape-not-offsets": (edit_header(shape_mismatch), "model.safetensors", "shape [1, 1]"),
    "header-length-absurd": (absurd_length, "model.safetensors", "header length"),
    "unknown-dtype": (edit_header(unknown_dtype), "model.safetensors", "dtype 'Q7'"),
    "hidden-size-huge": (edit_config(hidden_size=2**40), "config.json", "hidden_size"),
    "product-overflows": (edit_config(hidden_size=2**20, num_experts=2**14,
                                      moe_intermediate_size=2**22, num_hidden_layers=4096),
                          "config.json", "past int64"),
    "more-than-stored": (edit_config(hidden_size=4096), "config.json",
                         "the safetensors hold"),
    "zero-heads": (edit_config(num_attention_heads=0), "config.json", "num_attention_heads"),
    "string-field": (edit_config(hidden_size="32"), "config.json", "hidden_size is '32'"),
    "negative-layers": (edit_config(num_hidden_layers=-1), "config.json",
                        "num_hidden_layers is -1"),
    "deep-nesting": (deep_nesting, "config.json", "deep"),
    "pickled-only": (pickled_only, "", "pytorch_model.bin"),
    "index-outside": (index_outside, "model.safetensors.index.json", "../model.safetensors"),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("hf") / "llama", "llama", tokenizer=False)


@pytest.fixture(autouse=True)
def loom_logger_restored():
    """The commands set the "loom" logger up for a whole process; later tests need it back."""
    logger = logging.getLogger("loom")
    saved = logger.handlers[:], logger.level, logger.propagate
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


def crafted(pristine: Path, tmp_path: Path, case: str) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(pristine, folder)
    CASES[case][0](folder)
    return folder


def assert_refused(code: int, err: str, folder: Path, case: str) -> None:
    _, file, field = CASES[case]
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err)
    assert lines[0].startswith(f"error: {folder / file}".rstrip("/")), lines[0]
    assert field in lines[0] and "Traceback" not in err, lines[0]


def test_the_real_folder_is_accepted(pristine: Path) -> None:
    folder = open_folder(pristine)
    assert folder.config["hidden_size"] == 32
    assert folder.tensors["model.embed_tokens.weight"].shape == (328, 32)
    stored = load_file(pristine / "model.safetensors")
    assert folder.stored_elements == sum(t.numel() for t in stored.values())


@pytest.mark.parametrize("case", list(CASES))
def test_train_refuses_in_one_line(pristine, tmp_path, capsys, case) -> None:
    folder = crafted(pristine, tmp_path, case)
    code = run_train(["--model", str(folder), "--dataset", "random", "--max-steps", "1",
                      "--seq-len", "16", "--outdir", str(tmp_path / "run")])
    assert_refused(code, capsys.readouterr().err, folder, case)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", list(CASES))
def test_plan_refuses_in_one_line(pristine, tmp_path, capsys, case) -> None:
    folder = crafted(pristine, tmp_path, case)
    code = plan.main(["--world-size", "1", "--device-memory", "8GiB", "--model", str(folder),
                      "--seq-len", "16"])
    captured = capsys.readouterr()
    assert_refused(code, captured.err, folder, case)
    assert captured.out == ""


@pytest.mark.parametrize("case", list(CASES))
def test_generate_refuses_in_one_line(pristine, tmp_path, capsys, case) -> None:
    folder = crafted(pristine, tmp_path, case)
    code = generate.main([str(folder), "--prompt", "hi", "--max-new-tokens", "1"])
    captured = capsys.readouterr()
    assert_refused(code, captured.err, folder, case)
    assert captured.out == ""
