"""`--memory-snapshot` and the snapshot written on an out-of-memory error: refused in one
line off CUDA; on CUDA (torch's private recorder replaced by a fake here) the files land in
the run folder and the error names the file and the command that views it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import loom.trainer.entry
from loom.cli import run_train
from loom.errors import FAILURE_EXIT, DeviceOutOfMemory
from loom.observability.memory_snapshot import MemorySnapshots
from tests.harness import run_process


class FakeRecorder:
    """Stands in for torch.cuda.memory's private recorder on a machine without CUDA."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.calls: list[object] = []
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                            lambda enabled="all", **kw: self.calls.append(enabled))
        monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot",
                            lambda path: Path(path).write_bytes(b"snapshot"))


def test_snapshot_after_n_steps_then_recording_stops(tmp_path, monkeypatch):
    recorder = FakeRecorder(monkeypatch)
    snaps = MemorySnapshots(torch.device("cuda"), tmp_path, 1, after_steps=2)
    snaps.after_step(1)
    assert not (tmp_path / "memory-snapshot-rank1.pickle").exists()
    snaps.after_step(2)
    assert (tmp_path / "memory-snapshot-rank1.pickle").read_bytes() == b"snapshot"
    assert recorder.calls == ["all", None], "recorded from the start, stopped after the dump"
    snaps.finish()
    assert recorder.calls == ["all", None]


def test_out_of_memory_names_the_snapshot_and_the_viewer(tmp_path, monkeypatch):
    FakeRecorder(monkeypatch)
    snaps = MemorySnapshots(torch.device("cuda"), tmp_path, 0, after_steps=0)
    error = snaps.out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to "
                                                       "allocate 2.00 GiB\nmore detail"))
    path = tmp_path / "memory-oom-rank0.pickle"
    assert isinstance(error, DeviceOutOfMemory) and path.exists()
    message = str(error)
    assert "\n" not in message and str(path) in message
    assert "pytorch.org/memory_viz" in message and "_memory_viz trace_plot" in message


def test_cpu_keeps_the_error_and_refuses_the_flag(tmp_path):
    original = torch.OutOfMemoryError("out of memory")
    assert MemorySnapshots(torch.device("cpu"), tmp_path, 0, 0).out_of_memory(original) \
        is original
    out = run_process([sys.executable, "-m", "loom", "train", "--model", "debug",
                      "--dataset", "random", "--vocab-size", "256", "--seq-len", "32",
                      "--max-steps", "1", "--memory-snapshot", "--outdir",
                      str(tmp_path / "run")], timeout=300)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error")]
    assert out.returncode == 2 and len(errors) == 1, out.stderr[-3000:]
    assert "--memory-snapshot records CUDA's caching allocator" in errors[0]
    assert "Traceback" not in out.stderr


def test_out_of_memory_ends_the_rank_with_its_line_and_no_traceback(monkeypatch, capsys):
    """The CLI's end of it: exit 1, the snapshot's line, no traceback."""
    def out_of_memory(cfg):
        raise DeviceOutOfMemory("CUDA out of memory. Tried to allocate 2.00 GiB; allocator "
                                "snapshot in run/memory-oom-rank0.pickle: ...")

    monkeypatch.setattr(loom.trainer.entry, "fit", out_of_memory)
    assert run_train(["--model", "debug", "--dataset", "random"]) == FAILURE_EXIT
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert lines == ["error (rank 0): CUDA out of memory. Tried to allocate 2.00 GiB; "
                     "allocator snapshot in run/memory-oom-rank0.pickle: ..."], err
    assert "Traceback" not in err
