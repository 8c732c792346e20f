"""Hugging Face folders are hostile input: each crafted folder (tests/hf_crafted.py, built
here from a tiny `save_pretrained` one) makes `loom train`, `loom plan`, `loom generate`
and `loom verify` answer with one `error:` line naming the file and the field, exit 2, no
traceback and nothing written; the checked reader accepts the folder transformers wrote."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from safetensors.torch import load_file

from loom.cli import run_train
from loom.commands import generate, verify
from loom.config import ConfigError
from loom.models.hf_folder import open_folder, read_header
from loom.plan import command as plan
from tests.hf_crafted import CASES, assert_refused, crafted
from tests.hf_models import save_tiny_model

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("loom_logger_restored")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("hf") / "llama", "llama", tokenizer=False)


def test_the_real_folder_is_accepted(pristine: Path) -> None:
    folder = open_folder(pristine)
    assert folder.config["hidden_size"] == 32
    assert folder.tensors["model.embed_tokens.weight"].shape == (328, 32)
    stored = load_file(pristine / "model.safetensors")
    assert folder.stored_elements == sum(t.numel() for t in stored.values())


def _train(folder: Path, out: Path) -> int:
    return run_train(["--model", str(folder), "--dataset", "random", "--max-steps", "1",
                      "--seq-len", "16", "--outdir", str(out)])


def _plan(folder: Path, out: Path) -> int:
    return plan.main(["--world-size", "1", "--device-memory", "8GiB", "--model", str(folder),
                      "--seq-len", "16"])


def _generate(folder: Path, out: Path) -> int:
    return generate.main([str(folder), "--prompt", "hi", "--max-new-tokens", "1"])


def _verify(folder: Path, out: Path) -> int:
    return verify.main(["--layouts", "dp1", "dp1", "--model", str(folder), "--dataset",
                        "random", "--seq-len", "16", "--outdir", str(out)])


COMMANDS = {"train": _train, "plan": _plan, "generate": _generate, "verify": _verify}
"""Each command that opens a Hugging Face folder, given the folder and a place to write."""


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_refuses_in_one_line(pristine, tmp_path, capsys, command, case) -> None:
    folder = crafted(pristine, tmp_path, case)
    out = tmp_path / "out"
    code = COMMANDS[command](folder, out)
    captured = capsys.readouterr()
    assert_refused(code, captured.err, folder, case)
    assert captured.out == "" and not out.exists()


def safetensors_file(path: Path, header: dict, data: bytes) -> Path:
    text = json.dumps(header).encode() if isinstance(header, dict) else header
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


F32 = {"dtype": "F32", "shape": [2]}
HEADERS = {  # id: (header, data bytes, words of the refusal)
    "overlap": ({"a": {**F32, "data_offsets": [0, 8]}, "b": {**F32, "data_offsets": [4, 12]}},
                12, "tensor b: data_offsets [4, 12] overlap"),
    "gap": ({"a": {**F32, "data_offsets": [0, 8]}, "b": {**F32, "data_offsets": [12, 20]}},
            20, "tensor b: data_offsets [12, 20] leave a gap"),
    "trailing-bytes": ({"a": {**F32, "data_offsets": [0, 8]}}, 16, "cover 8 of its 16"),
    "key-twice": (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "a": {}}', 8,
                  "names 'a' twice"),
    "metadata-not-strings": ({"__metadata__": {"format": 1}}, 0, "__metadata__"),
    "shape-bool": ({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, 4,
                   "tensor a: shape"),
    "extra-key": ({"a": {**F32, "data_offsets": [0, 8], "x": 1}}, 8, "tensor a: not an entry"),
    "negative-offset": ({"a": {**F32, "data_offsets": [-8, 0]}}, 8, "lie outside"),
}


@pytest.mark.parametrize("case", list(HEADERS))
def test_a_lying_header_is_refused_naming_the_tensor(tmp_path, case) -> None:
    header, size, words = HEADERS[case]
    path = safetensors_file(tmp_path / "model.safetensors", header, b"\0" * size)
    with pytest.raises(ConfigError) as refused:
        read_header(path)
    assert str(refused.value).startswith(f"{path}: ") and words in str(refused.value)


def test_a_shard_that_is_a_link_or_fifo_is_refused(tmp_path) -> None:
    real = safetensors_file(tmp_path / "real.safetensors", {}, b"")
    assert read_header(real) == {}
    (tmp_path / "link.safetensors").symlink_to(real)
    os.mkfifo(tmp_path / "fifo.safetensors")
    for name in ("link.safetensors", "fifo.safetensors"):
        with pytest.raises(ConfigError, match="not a regular file"):
            read_header(tmp_path / name)
