"""Pruning deletes only this run's older checkpoints, never another run's or the new one."""

from __future__ import annotations

import json
from pathlib import Path

from loom.checkpoint.layout import complete_checkpoints, prunable


def fake_checkpoint(outdir: Path, step: int, run_id: str | None) -> Path:
    path = outdir / "checkpoints" / f"step-{step}"
    path.mkdir(parents=True)
    if run_id is not None:
        (path / "manifest.json").write_text(json.dumps({"run_id": run_id, "files": {}}))
    return path


def test_a_new_run_in_an_old_folder_prunes_only_its_own(tmp_path: Path) -> None:
    for step in (4, 6):
        fake_checkpoint(tmp_path, step, "old")
    fake_checkpoint(tmp_path, 8, None)  # unsealed or foreign: never ours
    ours = [fake_checkpoint(tmp_path, step, "new") for step in (1, 2, 3)]
    found = complete_checkpoints(tmp_path)
    assert [p.name for p in found] == [f"step-{s}" for s in (1, 2, 3, 4, 6, 8)]
    assert prunable(found, "new", keep=1, just_saved=ours[1]) == [ours[0], ours[2]]
    assert prunable(found, "new", keep=2, just_saved=ours[2]) == [ours[0]]
    assert prunable(found, "new", keep=5, just_saved=ours[2]) == []
