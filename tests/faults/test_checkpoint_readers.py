"""Every reader of a checkpoint fails on malformed input in one line: regular files only (a
FIFO never blocks), JSON sizes capped, chunks covering each tensor exactly, declared sizes
bounded by the files' bytes and by free memory before anything is allocated."""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import pytest
import torch

from loom.checkpoint.trust import UnusableCheckpoint, read_loop, verify_checkpoint
from loom.config import ConfigError
from loom.data.shards import read_manifest as read_shard_manifest
from loom.hf.run_checkpoint import load_model_state
from loom.models.llama.model import ModelArgs
from loom.safe_io import MAX_JSON_BYTES, read_json_capped
from tests.faults.test_checkpoint_trust import (
    TINY,
    copy_run,
    edit_metadata,
    loom,
    one_line,
    reseal,
)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    outdir = tmp_path_factory.mktemp("readers") / "run"
    proc = loom("train", *TINY, "--max-steps", "2", "--checkpoint-interval", "1",
                "--outdir", str(outdir))
    assert proc.returncode == 0, proc.stderr
    return outdir


def norm_chunk(**change):
    return lambda t: t["model.norm.weight"]["chunks"][0].update(change)


def split_norm(first: tuple[int, int], second: tuple[int, int]):
    """model.norm.weight (32 fp32) as two chunks [offset, size) over the same bytes."""
    def change(tensors):
        (chunk,) = tensors["model.norm.weight"]["chunks"]
        tensors["model.norm.weight"]["chunks"] = [
            {**chunk, "offsets": [o], "sizes": [s], "offset": chunk["offset"] + 4 * o,
             "length": 4 * s} for o, s in (first, second)]
    return change


def no_chunks(tensors):
    tensors["model.norm.weight"]["chunks"] = []


def huge_size(tensors):
    entry = tensors["model.norm.weight"]
    entry["size"] = [2**63]
    entry["chunks"][0]["sizes"] = [2**63]


def shared_bytes(tensors):
    """Two tensors whose chunks point at the same bytes (a way to declare more tensor
    than the file holds)."""
    src = tensors["model.layers.0.attention_norm.weight"]["chunks"][0]
    tensors["model.norm.weight"]["chunks"][0].update(offset=src["offset"])


METADATA_CRAFTS = {
    "dtype-list": (lambda t: t["model.norm.weight"].update(dtype=["float32"]),
                   "entry model.norm.weight has dtype ['float32']"),
    "size-2**63": (huge_size, "size of model.norm.weight is not a list of at most 8 integers"),
    "no-chunks": (no_chunks, "chunks of model.norm.weight leave part of it uncovered"),
    "gap": (split_norm((0, 10), (12, 20)), "chunks of model.norm.weight leave part of it "
                                           "uncovered"),
    "overlap": (split_norm((0, 20), (10, 22)), "chunks of model.norm.weight overlap"),
    "same-offsets": (split_norm((0, 16), (0, 16)), "chunks of model.norm.weight overlap"),
    "shared-bytes": (shared_bytes, "two chunks share bytes of __0_0.distcp"),
    "negative-offset": (norm_chunk(offset=-4), "offset is not an integer in [0, 2**48]"),
    "float-length": (norm_chunk(length=128.0), "length is not an integer"),
    "nine-dims": (lambda t: t["model.norm.weight"].update(size=[1] * 9),
                  "size of model.norm.weight is not a list of at most 8"),
}


@pytest.mark.parametrize("name", list(METADATA_CRAFTS))
def test_crafted_chunk_layouts_are_refused(run: Path, tmp_path: Path, name: str) -> None:
    checkpoint = copy_run(run, tmp_path) / "checkpoints" / "step-2"
    change, message = METADATA_CRAFTS[name]
    edit_metadata(checkpoint, change)
    reseal(checkpoint)
    with pytest.raises(UnusableCheckpoint) as error:
        verify_checkpoint(checkpoint)
    assert f"checkpoint {checkpoint} is unsafe: metadata.json " in str(error.value)
    assert message in str(error.value), error.value


def replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def replace_with_dir(path: Path) -> None:
    path.unlink()
    path.mkdir()


def replace_with_link(path: Path) -> None:
    target = path.with_name("elsewhere")
    path.rename(target)
    os.symlink(target, path)


@pytest.mark.parametrize("name", ["manifest.json", "metadata.json", "loop.json",
                                  "rng-0.json", "__0_0.distcp"])
@pytest.mark.parametrize("replace", [replace_with_fifo, replace_with_dir, replace_with_link],
                         ids=["fifo", "directory", "symlink"])
def test_a_non_regular_file_is_refused_and_never_blocks(run: Path, tmp_path: Path,
                                                        name: str, replace) -> None:
    checkpoint = copy_run(run, tmp_path) / "checkpoints" / "step-2"
    replace(checkpoint / name)
    outcome: list[BaseException | None] = []

    def attempt() -> None:
        try:
            verify_checkpoint(checkpoint)
            outcome.append(None)
        except BaseException as e:  # the test inspects whatever it was
            outcome.append(e)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), f"verify_checkpoint blocked on {name}"
    (error,) = outcome
    assert isinstance(error, UnusableCheckpoint), repr(error)
    kind = {"replace_with_fifo": "a FIFO", "replace_with_dir": "a directory",
            "replace_with_link": "a symbolic link"}[replace.__name__]
    assert f"{name} is {kind}, not a regular file" in str(error), error


def test_oversized_and_deeply_nested_json_is_refused(tmp_path: Path) -> None:
    sparse = tmp_path / "sparse.json"
    with sparse.open("wb") as f:
        f.truncate(64 << 30)  # 64 GB that occupy no disk
    with pytest.raises(ValueError, match="more than the .* allowed"):
        read_json_capped(sparse)
    nested = tmp_path / "nested.json"
    nested.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="nests too deeply"):
        read_json_capped(nested)
    assert MAX_JSON_BYTES < 1 << 30


@pytest.mark.parametrize("manifest", ["[" * 100_000, '{"files": {"../loop.json": '
                                      '{"bytes": 1, "xxh3": 1}}}', '{"files": []}',
                                      '{"files": {"loop.json": {"bytes": -1, "xxh3": 1}}}'])
def test_a_malformed_manifest_is_one_line(run: Path, tmp_path: Path, manifest: str) -> None:
    checkpoint = copy_run(run, tmp_path) / "checkpoints" / "step-2"
    (checkpoint / "manifest.json").write_text(manifest)
    with pytest.raises(UnusableCheckpoint, match="manifest.json is unreadable"):
        verify_checkpoint(checkpoint)


def edit_model_args(checkpoint: Path, **change) -> None:
    """A crafted but consistent record: `architecture` repeats `model_args` ({family, **args})."""
    loop = json.loads((checkpoint / "loop.json").read_text())
    loop["model_args"].update(change)
    loop["architecture"].update(change)
    (checkpoint / "loop.json").write_text(json.dumps(loop))
    reseal(checkpoint)


@pytest.mark.parametrize(("change", "error", "message"), [
    ({"dim": 4096}, UnusableCheckpoint, r"model_args describe 5\d\d,\d{3},\d{3} bytes of "
                                        "weights, its data files hold 234,672"),
    ({"n_layers": 100}, UnusableCheckpoint, "bytes of weights, its data files hold"),
    ({"max_seq_len": 2**30}, ConfigError, r"needs ~64.0 GiB of memory, more than the 4.0 GiB "
                                          "available; nothing was allocated"),
])
def test_declared_sizes_are_bounded_before_allocation(run: Path, tmp_path: Path, change,
                                                      error: type, message: str,
                                                      monkeypatch) -> None:
    checkpoint = copy_run(run, tmp_path) / "checkpoints" / "step-2"
    edit_model_args(checkpoint, **change)
    monkeypatch.setattr("loom.runtime.preflight.available_memory_bytes", lambda: 4 << 30)
    with pytest.raises(error, match=message):
        load_model_state(checkpoint)


@pytest.mark.multirank
@pytest.mark.parametrize("command", ["export", "generate"])
def test_export_and_generate_refuse_a_crafted_checkpoint_in_one_line(
        run: Path, tmp_path: Path, command: str) -> None:
    checkpoint = copy_run(run, tmp_path) / "checkpoints" / "step-2"
    edit_metadata(checkpoint, split_norm((0, 20), (10, 22)))
    reseal(checkpoint)
    argv = [str(checkpoint), str(tmp_path / "out")] if command == "export" else \
        [str(checkpoint), "--prompt", "hi"]
    proc = loom(command, *argv)
    assert proc.returncode == 2, proc.stderr
    assert one_line(proc) == (f"error: checkpoint {checkpoint} is unsafe: metadata.json "
                              "chunks of model.norm.weight overlap")
    assert not (tmp_path / "out").exists()


@pytest.mark.multirank
def test_auto_resume_skips_a_fifo_in_the_newest_checkpoint(run: Path, tmp_path: Path) -> None:
    outdir = copy_run(run, tmp_path)
    step1, step2 = outdir / "checkpoints" / "step-1", outdir / "checkpoints" / "step-2"
    replace_with_fifo(step2 / "__0_0.distcp")
    proc = loom("train", *TINY, "--max-steps", "2", "--outdir", str(outdir), "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    assert "skipping step-2 (checkpoint step-2 is corrupt: __0_0.distcp is a FIFO" in proc.stdout
    assert f"resumed from {step1} at step 1" in proc.stdout


def shard_folder(root: Path) -> Path:
    """A hand-made two-shard folder as `loom tokenize` writes one (6 uint16 tokens)."""
    root.mkdir()
    (root / "shard-00000.bin").write_bytes(bytes(8))
    (root / "shard-00001.bin").write_bytes(bytes(4))
    (root / "manifest.json").write_text(json.dumps({
        "format": 1, "dtype": "uint16", "shard_tokens": 4, "n_tokens": 6,
        "shards": [{"file": "shard-00000.bin", "tokens": 4},
                   {"file": "shard-00001.bin", "tokens": 2}]}))
    return root


def edit_shards(folder: Path, change) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    change(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


SHARD_CRAFTS = {
    "a-list": (lambda m: m.clear(), "shard format None"),
    "dtype-list": (lambda m: m.update(dtype=["uint16"]), "dtype ['uint16'] is not one of"),
    "dtype-object": (lambda m: m.update(dtype="object"), "dtype 'object' is not one of"),
    "traversal": (lambda m: m["shards"][0].update(file="../../etc/passwd"),
                  "shards is not a list of"),
    "negative": (lambda m: m["shards"][1].update(tokens=-2), "shards is not a list of"),
    "lying-total": (lambda m: m.update(n_tokens=2**40), "n_tokens is not the shards' sum"),
    "string-count": (lambda m: m.update(shard_tokens="4"), "shard_tokens or n_tokens"),
}


@pytest.mark.parametrize("name", list(SHARD_CRAFTS))
def test_a_crafted_shard_manifest_is_one_line(tmp_path: Path, name: str) -> None:
    folder = shard_folder(tmp_path / "shards")
    assert read_shard_manifest(folder)["n_tokens"] == 6
    change, message = SHARD_CRAFTS[name]
    if name == "a-list":
        (folder / "manifest.json").write_text("[]")
    else:
        edit_shards(folder, change)
    with pytest.raises(ConfigError, match=re.escape(message)):
        read_shard_manifest(folder)


@pytest.mark.parametrize("replace", [replace_with_fifo, replace_with_dir, replace_with_link],
                         ids=["fifo", "directory", "symlink"])
def test_a_shard_that_is_no_regular_file_is_refused(tmp_path: Path, replace) -> None:
    folder = shard_folder(tmp_path / "shards")
    replace(folder / "shard-00001.bin")
    with pytest.raises(ConfigError, match="shard-00001.bin is missing, not a regular file"):
        read_shard_manifest(folder)


@pytest.mark.multirank
@pytest.mark.parametrize("command", ["train", "export"])
def test_a_tensor_missing_from_resealed_metadata_is_one_line(run: Path, tmp_path: Path,
                                                             command: str) -> None:
    """DCP's CheckpointException is a BaseException: it must not escape as a traceback."""
    outdir = copy_run(run, tmp_path)
    checkpoint = outdir / "checkpoints" / "step-2"
    edit_metadata(checkpoint, lambda tensors: tensors.pop("model.norm.weight"))
    reseal(checkpoint)
    argv = (["train", *TINY, "--max-steps", "3", "--outdir", str(outdir), "--resume",
             str(checkpoint)] if command == "train" else
            ["export", str(checkpoint), str(tmp_path / "out")])
    proc = loom(*argv)
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc)
    assert line.startswith(f"error: checkpoint {checkpoint} cannot be loaded: ") and \
        "model.norm.weight" in line, line
    assert "Traceback" not in proc.stderr + proc.stdout


LATER_LLAMA_FIELDS = ("head_dim", "qk_norm", "rope_factor", "rope_low_freq_factor",
                      "rope_high_freq_factor", "rope_original_max_seq_len", "tie_embeddings")
"""Fields Llama's arguments gained after the first checkpoints (absent from those)."""


def write_legacy_record(checkpoint: Path) -> dict:
    """Rewrite loop.json as loom wrote it before families owned their arguments: a flat
    Llama model_args without the later fields, an architecture of kind and shapes."""
    loop = json.loads((checkpoint / "loop.json").read_text())
    args = loop["model_args"]
    ffn = args["hidden_dim"] or ModelArgs(**args).ffn_hidden_dim
    loop["model_args"] = {k: v for k, v in args.items() if k not in LATER_LLAMA_FIELDS}
    loop["architecture"] = {"kind": "dense", **{k: args[k] for k in (
        "dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size")}, "ffn_hidden_dim": ffn}
    (checkpoint / "loop.json").write_text(json.dumps(loop))
    reseal(checkpoint)
    return args


def test_a_checkpoint_of_the_flat_record_loads_as_family_and_arguments(
        run: Path, tmp_path: Path) -> None:
    """A checkpoint written before `{family, **args}` reads as the Llama family with its
    arguments (later fields at their defaults), loads the same tensors, and resumes."""
    legacy = copy_run(run, tmp_path) / "checkpoints" / "step-1"
    args = write_legacy_record(legacy)
    upgraded = read_loop(legacy)
    assert upgraded["architecture"] == {"family": "llama", **args}
    assert upgraded["model_args"] == args
    state, loaded = load_model_state(legacy)
    reference, _ = load_model_state(run / "checkpoints" / "step-1")
    assert loaded == ModelArgs(**args) and state.keys() == reference.keys()
    assert all(torch.equal(state[k], reference[k]) for k in state)
    proc = loom("train", *TINY, "--max-steps", "2", "--resume", str(legacy),
                "--outdir", str(tmp_path / "resumed"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = loom("train", *TINY, "--dim", "64", "--max-steps", "2", "--resume", str(legacy),
                "--outdir", str(tmp_path / "other"))
    assert proc.returncode == 2 and "checkpoint has dim 32, this run 64" in proc.stderr, \
        proc.stderr[-2000:]
