"""Crafted Hugging Face folders, one per class of hostile input the folder reader refuses
(a safetensors header that lies, a config.json value out of range or of the wrong type,
only pickled weights, an index naming a file outside the folder): built from a real tiny
folder by each test, never shipped; with the file and field each refusal must name."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import torch


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
    "in-range-but-huge": (edit_config(hidden_size=2**20, vocab_size=2**25), "config.json",
                          "the safetensors hold"),  # 2**45 weights: never built
    "zero-heads": (edit_config(num_attention_heads=0), "config.json", "num_attention_heads"),
    "string-field": (edit_config(hidden_size="32"), "config.json", "hidden_size is '32'"),
    "negative-layers": (edit_config(num_hidden_layers=-1), "config.json",
                        "num_hidden_layers is -1"),
    "deep-nesting": (deep_nesting, "config.json", "deep"),
    "pickled-only": (pickled_only, "", "pytorch_model.bin"),
    "index-outside": (index_outside, "model.safetensors.index.json", "../model.safetensors"),
}


def crafted(pristine: Path, tmp_path: Path, case: str) -> Path:
    """A copy of `pristine` in `tmp_path`, crafted as `case` says."""
    folder = tmp_path / "model"
    shutil.copytree(pristine, folder)
    CASES[case][0](folder)
    return folder


def assert_refused(code: int, err: str, folder: Path, case: str,
                   field: str | None = None) -> None:
    """Exit 2 and one `error:` line that starts with the file and names the field (the
    case's, unless the command words it as `field`)."""
    _, file, named = CASES[case]
    field = field or named
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err)
    assert lines[0].startswith(f"error: {folder / file}".rstrip("/")), lines[0]
    assert field in lines[0] and "Traceback" not in err, lines[0]
