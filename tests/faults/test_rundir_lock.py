"""A run folder belongs to one run: the lock, refusing a used folder, --overwrite, --resume."""

from __future__ import annotations

import errno
import json
import os
import signal
from pathlib import Path

import pytest

from loom.config import ConfigError
from loom.observability.metrics import run_history
from loom.runtime.rundir import LOCK_NAME, MARKER, claim
from tests.faults.procs import (
    digest,
    error_lines,
    finish,
    steps_logged,
    train,
    wait_for,
)


def fake_run(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}\n")
    (folder / "metrics-0.jsonl").write_text('{"train/iter": 1}\n')
    (folder / MARKER).write_text("a loom run folder\n")


def test_a_used_folder_is_refused_unless_resume_or_overwrite(tmp_path: Path) -> None:
    run = tmp_path / "run"
    fake_run(run)
    before = digest(run)
    with pytest.raises(ConfigError, match="already holds a run; pass --resume"):
        claim(run, resume=False, overwrite=False)
    assert digest(run) == before, "a refused run changed the old run's files"
    lock, note = claim(run, resume=True, overwrite=False)
    assert note == "" and digest(run) == before
    lock.close()
    lock, note = claim(run, resume=False, overwrite=True)
    (aside,) = tmp_path.glob("run.old-*")
    assert f"moved to {aside}" in note
    assert digest(aside) == before
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME, MARKER]
    lock.close()


def test_a_held_lock_refuses_a_second_claim_and_dies_with_its_holder(tmp_path: Path) -> None:
    lock, _ = claim(tmp_path / "run", resume=False, overwrite=False)
    with pytest.raises(ConfigError, match=r"in use by a running job \(pid \d+ on "):
        claim(tmp_path / "run", resume=True, overwrite=False)
    lock.close()  # what the kernel does when the holder dies, however it dies
    claim(tmp_path / "run", resume=True, overwrite=False)[0].close()


def test_overwrite_of_a_run_with_a_255_byte_name_moves_it_to_a_shortened_name(
        tmp_path: Path) -> None:
    """`<name>.old-<time>` is longer than the name: the move keeps it under 255 bytes."""
    run = tmp_path / ("r" * 255)
    fake_run(run)
    before = digest(run)
    lock, note = claim(run, resume=False, overwrite=True)
    lock.close()
    (aside,) = (p for p in tmp_path.iterdir() if p != run)
    assert ".old-" in aside.name and len(os.fsencode(aside.name)) <= 255, aside.name
    assert digest(aside) == before and f"moved to {aside}" in note


def test_overwrite_that_cannot_move_the_run_aside_moves_nothing(tmp_path: Path,
                                                                monkeypatch) -> None:
    """A run folder that is a mount point: its entries cannot be renamed into a sibling
    (EXDEV). The first entries moved go back; one line, no empty `.old-` folder."""
    run = tmp_path / "run"
    fake_run(run)
    before = digest(run)
    real, calls = Path.rename, []

    def rename(self: Path, target: Path) -> Path:
        calls.append(self)
        if len(calls) == 2:  # the first entry moved, the second refused
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        return real(self, target)
    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(ConfigError, match=r"--overwrite cannot move the previous run to "
                       r"run\.old-.*; nothing was moved \(it is a mount point"):
        claim(run, resume=False, overwrite=True)
    assert digest(run) == before and os.listdir(tmp_path) == ["run"]


def test_resumed_rows_replace_the_steps_they_repeat() -> None:
    rows = [{"train/iter": i, "run": "a"} for i in (1, 2, 3, 4)] + \
           [{"train/iter": i, "run": "b"} for i in (3, 4, 5)]
    history = run_history(rows)
    assert [(r["train/iter"], r["run"]) for r in history] == \
        [(1, "a"), (2, "a"), (3, "b"), (4, "b"), (5, "b")], history


@pytest.mark.multirank
def test_second_run_into_a_live_folder_then_a_rerun_into_a_used_one(tmp_path: Path) -> None:
    """A live run keeps its folder; Ctrl-C ends it with summary and plots for the steps done;
    a later run without --resume/--overwrite leaves every file byte for byte."""
    run = tmp_path / "run"
    first = train(run, "--max-steps", "100000")
    try:
        wait_for(lambda: steps_logged(run) >= 2, "second step", 180, first)
        code, _, err = finish(train(run, "--max-steps", "2"), 120)
        assert code == 2, err
        assert error_lines(err) == [next(line for line in err.splitlines()
                                         if "is in use by a running job" in line)], err
        assert "Traceback" not in err
        first.send_signal(signal.SIGINT)
        code, _, err = finish(first, 120)
    finally:
        first.kill()
    assert code == 130, err
    (line,) = error_lines(err)
    assert line.startswith("loom: stopped by SIGINT after step "), err
    steps = int(line.split("after step ")[1].split(";")[0])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps == steps_logged(run) >= 2, (summary["steps"], steps)
    assert (run / "plots" / "loss.png").is_file()

    before = digest(run)
    code, _, err = finish(train(run, "--max-steps", "2"), 120)
    assert code == 2, err
    assert error_lines(err) == [f"error: --outdir {run} already holds a run; pass --resume to "
                                "continue it, --overwrite to move it aside, or choose another "
                                "--outdir"], err
    assert digest(run) == before, "the refused rerun changed the first run's files"
