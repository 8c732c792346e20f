"""Crafted, corrupt and unwritable checkpoints: each is one line and a non-zero exit, no
crafted code runs, and the previous checkpoint stays usable."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from loom.checkpoint.format import METADATA, TensorReader
from loom.checkpoint.layout import complete_checkpoints
from loom.checkpoint.trust import UnusableCheckpoint, file_record, read_metadata, verify_checkpoint
from tests.compare import rows
from tests.harness import free_port, rank_env, run_process, run_ranks

TINY = ["--model", "debug", "--dim", "32", "--n-layers", "1", "--n-heads", "2",
        "--n-kv-heads", "1", "--vocab-size", "64", "--seq-len", "16", "--dataset", "random",
        "--fp32", "--seed", "3"]
HANG_LIMIT = 150  # idle: ~10 s
CACHE = {"LOOM_CACHE_DIR": tempfile.mkdtemp(prefix="loom-test-cache-")}
"""A private cache: runs of other checkouts on this machine may write another format."""


def loom(*argv: str) -> subprocess.CompletedProcess:
    """One `python -m loom` process; past HANG_LIMIT it is killed and the test fails."""
    return run_process([sys.executable, "-m", "loom", *argv],
                       env=rank_env(0, 1, free_port(), CACHE), timeout=HANG_LIMIT)


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{proc.stderr}"
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run folder with checkpoints step-2 and step-3 (the default keeps two)."""
    outdir = tmp_path_factory.mktemp("trust") / "run"
    proc = loom("train", *TINY, "--max-steps", "3", "--checkpoint-interval", "1",
                   "--outdir", str(outdir))
    assert proc.returncode == 0, proc.stderr
    return outdir


def copy_run(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def reseal(checkpoint: Path) -> None:
    """Rewrite the manifest as an attacker would, so only the content checks remain."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"] = {p.name: file_record(p) for p in checkpoint.iterdir()
                         if p.name != "manifest.json"}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


class Touch:
    """Unpickling this runs `touch <marker>`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def global_route(checkpoint: Path, marker: Path) -> bytes:
    """A .metadata naming os.system through DCP's metadata module (which imports os)."""
    return (b"\x80\x04c" + b"torch.distributed.checkpoint.metadata\nos.system\n(V"
            + f"touch {marker}".encode() + b"\ntR.")


def plant_metadata_pickle(checkpoint: Path, marker: Path) -> None:
    """A `.metadata` (DCP's own metadata file name) that runs `touch` when unpickled."""
    (checkpoint / ".metadata").write_bytes(global_route(checkpoint, marker))


def edit_metadata(checkpoint: Path, change) -> None:
    metadata = json.loads((checkpoint / METADATA).read_text())
    change(metadata["tensors"])
    (checkpoint / METADATA).write_text(json.dumps(metadata))


def craft_object_entry(checkpoint: Path, marker: Path) -> None:
    """A pickled object appended to a data file and declared as an entry in place of a
    tensor."""
    data = checkpoint / "__0_0.distcp"
    payload = pickle.dumps(Touch(marker))
    offset = data.stat().st_size
    data.write_bytes(data.read_bytes() + payload)
    edit_metadata(checkpoint, lambda tensors: tensors.update({"model.tok_embeddings.weight": {
        "bytes": {"file": "__0_0.distcp", "offset": offset, "length": len(payload)}}}))


def craft_outside_file(checkpoint: Path, marker: Path) -> None:
    """A chunk stored outside the checkpoint folder (path traversal)."""
    outside = checkpoint.parent.parent / "outside.distcp"
    outside.write_bytes(pickle.dumps(Touch(marker)))
    edit_metadata(checkpoint, lambda tensors: tensors["model.norm.weight"]["chunks"][0].update(
        file="../../outside.distcp"))


def craft_past_the_end(checkpoint: Path, marker: Path) -> None:
    size = (checkpoint / "__0_0.distcp").stat().st_size
    edit_metadata(checkpoint, lambda tensors: tensors["model.norm.weight"]["chunks"][0].update(
        offset=size))


def craft_wrong_length(checkpoint: Path, marker: Path) -> None:
    edit_metadata(checkpoint, lambda tensors: tensors["model.norm.weight"]["chunks"][0].update(
        length=3))


def craft_garbage(checkpoint: Path, marker: Path) -> None:
    (checkpoint / METADATA).write_text("{not json")


def craft_missing(checkpoint: Path, marker: Path) -> None:
    (checkpoint / METADATA).unlink()


CRAFTS = {
    craft_object_entry: "unsafe: metadata.json entry model.tok_embeddings.weight is not a "
                        "tensor",
    craft_outside_file: "unsafe: metadata.json a chunk of model.norm.weight points at "
                        "'../../outside.distcp', which is not a data file",
    craft_past_the_end: "unsafe: metadata.json reads past the end of __0_0.distcp",
    craft_wrong_length: "unsafe: metadata.json a chunk of model.norm.weight has 3 bytes, its "
                        "sizes need 128",
    craft_garbage: "unsafe: metadata.json Expecting property name",
    craft_missing: "corrupt: metadata.json not in manifest.json",
}


def saved_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a one-rank checkpoint, read through loom's reader."""
    metadata = read_metadata(checkpoint)
    state = {fqn: torch.empty(entry.size, dtype=entry.properties.dtype)
             for fqn, entry in metadata.state_dict_metadata.items()}
    dcp.load(state, storage_reader=TensorReader(checkpoint), no_dist=True)
    return state


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    worst = max(((a[k].double() - b[k].double()).abs().max().item(), k) for k in a)
    assert worst[0] == 0, f"worst difference {worst[0]} in {worst[1]}"


def test_the_crafted_payloads_run_code_when_unpickled_plainly(tmp_path: Path) -> None:
    """The attacks below are real: plain unpickling runs them."""
    for i, payload in enumerate([global_route(tmp_path, tmp_path / "m0"),
                                 pickle.dumps(Touch(tmp_path / "m1"))]):
        pickle.loads(payload)
        assert (tmp_path / f"m{i}").exists()


@pytest.mark.parametrize("craft", list(CRAFTS), ids=lambda craft: craft.__name__)
def test_crafted_metadata_is_refused_naming_the_problem(run: Path, tmp_path: Path,
                                                        craft) -> None:
    checkpoint = copy_run(run, tmp_path) / "checkpoints" / "step-2"
    craft(checkpoint, tmp_path / "marker")
    reseal(checkpoint)
    with pytest.raises(UnusableCheckpoint) as error:
        verify_checkpoint(checkpoint)
    assert CRAFTS[craft] in str(error.value), error.value
    assert not (tmp_path / "marker").exists()


@pytest.mark.multirank
def test_a_planted_metadata_pickle_is_never_opened(run: Path, tmp_path: Path) -> None:
    """A `.metadata` that would run code sits in step-2, even listed in the manifest:
    resume and export ignore it, and the resumed step 3 equals the original bit for bit."""
    outdir = copy_run(run, tmp_path)
    step2, step3 = outdir / "checkpoints" / "step-2", outdir / "checkpoints" / "step-3"
    original = saved_tensors(step3)
    shutil.rmtree(step3)
    marker = tmp_path / "marker"
    plant_metadata_pickle(step2, marker)
    reseal(step2)
    proc = loom("train", *TINY, "--max-steps", "3", "--checkpoint-interval", "1",
                   "--outdir", str(outdir), "--resume", str(step2))
    assert proc.returncode == 0, proc.stderr
    proc = loom("export", str(step2), str(tmp_path / "exported"))
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists(), "the planted .metadata was unpickled"
    assert_bit_equal(saved_tensors(step3), original)
    assert not (step3 / ".metadata").exists()


@pytest.mark.multirank
@pytest.mark.parametrize(("craft", "command"), [(craft_object_entry, "train"),
                                                (craft_outside_file, "export"),
                                                (craft_missing, "export")])
def test_a_crafted_checkpoint_is_one_line_and_never_runs_code(run: Path, tmp_path: Path,
                                                              craft, command: str) -> None:
    outdir = copy_run(run, tmp_path)
    checkpoint, marker = outdir / "checkpoints" / "step-2", tmp_path / "marker"
    craft(checkpoint, marker)
    reseal(checkpoint)
    argv = (["train", *TINY, "--max-steps", "3", "--outdir", str(outdir), "--resume",
             str(checkpoint)] if command == "train" else
            ["export", str(checkpoint), str(tmp_path / "exported")])
    proc = loom(*argv)
    line = one_line(proc)
    assert proc.returncode == 2 and CRAFTS[craft] in line and str(checkpoint) in line, line
    assert not marker.exists(), f"the crafted command ran ({line})"
    assert not (tmp_path / "exported").exists()


@pytest.mark.multirank
def test_tampered_metadata_is_one_line_naming_it(run: Path, tmp_path: Path) -> None:
    outdir = copy_run(run, tmp_path)
    checkpoint = outdir / "checkpoints" / "step-3"
    edit_metadata(checkpoint, lambda tensors: tensors.pop("model.norm.weight"))
    proc = loom("train", *TINY, "--outdir", str(outdir), "--resume", str(checkpoint))
    assert proc.returncode == 2
    line = one_line(proc)
    assert line.startswith("error: checkpoint step-3 is corrupt: metadata.json has ") and \
        line.endswith(f"; resume from step-2 with --resume {outdir}/checkpoints/step-2"), line


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.multirank
def test_corrupt_bytes_are_named_and_auto_resume_takes_the_previous(run: Path,
                                                                    tmp_path: Path) -> None:
    outdir = copy_run(run, tmp_path)
    step2, step3 = complete_checkpoints(outdir)
    flip_a_byte(step3 / "__0_0.distcp")
    proc = loom("train", *TINY, "--outdir", str(outdir), "--resume", str(step3))
    assert proc.returncode == 2
    assert one_line(proc) == (f"error: checkpoint step-3 is corrupt: __0_0.distcp checksum "
                              f"mismatch; resume from step-2 with --resume {step2}")
    proc = loom("train", *TINY, "--outdir", str(outdir), "--resume", "auto",
                   "--max-steps", "3")
    assert proc.returncode == 0, proc.stderr
    assert "skipping step-3 (checkpoint step-3 is corrupt" in proc.stdout
    assert f"resumed from {step2} at step 2" in proc.stdout
    verify_checkpoint(step2)


@pytest.mark.multirank
def test_resume_errors_are_one_line_before_the_model_is_built(run: Path,
                                                              tmp_path: Path) -> None:
    proc = loom("train", *TINY, "--outdir", str(tmp_path / "empty"), "--resume")
    assert proc.returncode == 2
    assert "no checkpoint in" in one_line(proc) and "--resume auto" in proc.stderr
    proc = loom("train", *TINY[:2], "--dim", "64", *TINY[4:], "--outdir", str(run),
                   "--resume")
    assert proc.returncode == 2
    assert one_line(proc) == ("error: --resume: checkpoint has dim 32, this run 64; give the "
                              "checkpoint's model flags")
    assert "parameters" not in proc.stdout  # the model was never built


@pytest.mark.multirank
def test_disk_full_is_one_line_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """Rank 1's storage reports ENOSPC on the second save (no small tmpfs in CI)."""
    result = run_ranks(2, ["tests/workers/enospc_worker.py", *TINY, "--max-steps", "3",
                           "--checkpoint-interval", "1", "--outdir", str(tmp_path)],
                       timeout=HANG_LIMIT * 2, env=CACHE)
    assert [r.returncode for r in result.ranks] == [1, 1], result.describe()
    line = result.ranks[0].stderr.strip()
    assert line.startswith(f"error: disk full writing checkpoint {tmp_path}/checkpoints/"
                           ".step-2.tmp: it needs about ") and "\n" not in line, line
    assert result.ranks[1].stderr.strip() == ""
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-1"]
    verify_checkpoint(tmp_path / "checkpoints" / "step-1")
    assert [r["train/iter"] for r in rows(tmp_path)] == [1, 2]
