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
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from loom.checkpoint import complete_checkpoints
from loom.checkpoint_trust import file_record, verify_checkpoint
from tests.compare import rows
from tests.harness import REPO, free_port, rank_env, run_ranks

TINY = ["--model", "debug", "--dim", "32", "--n-layers", "1", "--n-heads", "2",
        "--n-kv-heads", "1", "--vocab-size", "64", "--seq-len", "16", "--dataset", "random",
        "--fp32", "--seed", "3"]
HANG_LIMIT = 150  # idle: ~10 s
CACHE = {"LOOM_CACHE_DIR": tempfile.mkdtemp(prefix="loom-test-cache-")}
"""A private cache: runs of other checkouts on this machine may write another format."""


def loom(*argv: str) -> subprocess.CompletedProcess:
    """One `python -m loom` process; past HANG_LIMIT it is killed and the test fails."""
    return subprocess.run([sys.executable, "-m", "loom", *argv], cwd=REPO, text=True,
                          env=rank_env(0, 1, free_port(), CACHE), capture_output=True,
                          timeout=HANG_LIMIT)


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{proc.stderr}"
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run folder with checkpoints step-1 and step-2."""
    outdir = tmp_path_factory.mktemp("trust") / "run"
    proc = loom("train", *TINY, "--max-steps", "2", "--checkpoint-interval", "1",
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


def craft_global(checkpoint: Path, marker: Path) -> None:
    (checkpoint / ".metadata").write_bytes(global_route(checkpoint, marker))


def _metadata(checkpoint: Path):
    with open(checkpoint / ".metadata", "rb") as f:
        return pickle.load(f)  # our own checkpoint, written a moment ago by the fixture


def craft_object_entry(checkpoint: Path, marker: Path) -> None:
    """An entry declared as a pickled object, appended to a data file: torch's default
    planner reads such entries with weights_only=False."""
    metadata, data = _metadata(checkpoint), checkpoint / "__0_0.distcp"
    payload = pickle.dumps(Touch(marker))
    offset = data.stat().st_size
    data.write_bytes(data.read_bytes() + payload)
    key = "model.tok_embeddings.weight"
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data = {i: s for i, s in metadata.storage_data.items() if i.fqn != key}
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo("__0_0.distcp", offset,
                                                             len(payload))
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))


def craft_outside_file(checkpoint: Path, marker: Path) -> None:
    """A data file outside the checkpoint folder (path traversal) holding a pickle."""
    metadata = _metadata(checkpoint)
    outside = checkpoint.parent.parent / "outside.distcp"
    outside.write_bytes(pickle.dumps(Touch(marker)))
    metadata.storage_data = {i: _StorageInfo("../../outside.distcp", 0, outside.stat().st_size)
                             for i in metadata.storage_data}
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))


def test_the_crafted_payloads_run_code_when_unpickled_plainly(tmp_path: Path) -> None:
    """The attacks below are real: plain unpickling runs them."""
    for i, payload in enumerate([global_route(tmp_path, tmp_path / "m0"),
                                 pickle.dumps(Touch(tmp_path / "m1"))]):
        pickle.loads(payload)
        assert (tmp_path / f"m{i}").exists()


@pytest.mark.multirank
@pytest.mark.parametrize("craft", [craft_global, craft_object_entry, craft_outside_file])
@pytest.mark.parametrize("command", ["train", "export"])
def test_a_crafted_checkpoint_never_runs_code(run: Path, tmp_path: Path, craft,
                                              command: str) -> None:
    outdir = copy_run(run, tmp_path)
    checkpoint, marker = outdir / "checkpoints" / "step-2", tmp_path / "marker"
    craft(checkpoint, marker)
    reseal(checkpoint)
    argv = (["train", *TINY, "--max-steps", "3", "--outdir", str(outdir), "--resume",
             str(checkpoint)] if command == "train" else
            ["export", str(checkpoint), str(tmp_path / "exported")])
    proc = loom(*argv)
    line = one_line(proc)
    assert proc.returncode != 0 and "unsafe: .metadata" in line and str(checkpoint) in line, line
    assert not marker.exists(), f"the crafted command ran ({line})"
    assert not (tmp_path / "exported").exists()


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.multirank
def test_corrupt_bytes_are_named_and_auto_resume_takes_the_previous(run: Path,
                                                                    tmp_path: Path) -> None:
    outdir = copy_run(run, tmp_path)
    step1, step2 = complete_checkpoints(outdir)
    flip_a_byte(step2 / "__0_0.distcp")
    proc = loom("train", *TINY, "--outdir", str(outdir), "--resume", str(step2))
    assert proc.returncode == 2
    assert one_line(proc) == (f"error: checkpoint step-2 is corrupt: __0_0.distcp checksum "
                              f"mismatch; resume from step-1 with --resume {step1}")
    proc = loom("train", *TINY, "--outdir", str(outdir), "--resume", "auto",
                   "--max-steps", "2")
    assert proc.returncode == 0, proc.stderr
    assert "skipping step-2 (checkpoint step-2 is corrupt" in proc.stdout
    assert f"resumed from {step1} at step 1" in proc.stdout
    verify_checkpoint(step1)


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
