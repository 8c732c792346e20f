"""`--resume auto` follows the branch a `--resume PATH` started: the later checkpoints of
the branch it left are set aside, never chosen."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loom.checkpoint.layout import complete_checkpoints
from loom.checkpoint.resume import set_aside_later
from tests.faults.test_checkpoint_trust import TINY, loom


def fake_checkpoints(outdir: Path, steps: list[int]) -> None:
    for step in steps:
        (outdir / "checkpoints" / f"step-{step}").mkdir(parents=True)


def test_later_checkpoints_are_set_aside_and_earlier_kept(tmp_path: Path) -> None:
    fake_checkpoints(tmp_path, [2, 4, 5, 6])
    aside = set_aside_later(tmp_path, tmp_path / "checkpoints" / "step-4", 4)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-2", "step-4"]
    assert sorted(p.name for p in aside.iterdir()) == ["step-5", "step-6"]
    assert aside.parent == tmp_path / "checkpoints" and aside.name.startswith("abandoned-")
    assert set_aside_later(tmp_path, tmp_path / "checkpoints" / "step-4", 4) is None


def test_a_checkpoint_from_another_folder_sets_aside_this_folders_later_ones(tmp_path: Path
                                                                             ) -> None:
    fake_checkpoints(tmp_path / "here", [1, 3])
    fake_checkpoints(tmp_path / "there", [2])
    set_aside_later(tmp_path / "here", tmp_path / "there" / "checkpoints" / "step-2", 2)
    assert [p.name for p in complete_checkpoints(tmp_path / "here")] == ["step-1"]


def lr_of(checkpoint: Path) -> float:
    return json.loads((checkpoint / "loop.json").read_text())["settings"]["lr"]


@pytest.mark.multirank
def test_auto_resume_continues_the_new_branch(tmp_path: Path) -> None:
    outdir = tmp_path / "run"
    common = [*TINY, "--checkpoint-interval", "1", "--keep-checkpoints", "5", "--outdir",
              str(outdir)]
    proc = loom("train", *common, "--max-steps", "3")
    assert proc.returncode == 0, proc.stderr
    step1 = outdir / "checkpoints" / "step-1"
    proc = loom("train", *common, "--max-steps", "2", "--resume", str(step1), "--lr", "0.01")
    assert proc.returncode == 0, proc.stderr
    assert "--resume step-1: the later checkpoints of the branch it leaves were moved" \
        in proc.stdout
    (aside,) = (outdir / "checkpoints").glob("abandoned-*")
    assert sorted(p.name for p in aside.iterdir()) == ["step-2", "step-3"]
    assert [p.name for p in complete_checkpoints(outdir)] == ["step-1", "step-2"]
    assert lr_of(outdir / "checkpoints" / "step-2") == 0.01
    proc = loom("train", *common, "--max-steps", "3", "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    assert f"resumed from {outdir / 'checkpoints' / 'step-2'} at step 2" in proc.stdout
    assert "resume: restored from step-2: lr 0.01," in proc.stdout
    assert lr_of(outdir / "checkpoints" / "step-3") == 0.01
