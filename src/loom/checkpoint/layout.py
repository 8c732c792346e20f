"""Where checkpoints live in an output folder: the `checkpoints/step-N` naming, which
folders are finished checkpoints, which run sealed each, and which a save may prune.

Kept apart from `loom.checkpoint.checkpointer` because resume and pruning only read the
layout; they need none of the save and load machinery.
"""

from __future__ import annotations

import re
from pathlib import Path

from loom.checkpoint.trust import MANIFEST
from loom.safe_io import read_json_capped

_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_dir(outdir: Path) -> Path:
    return outdir / "checkpoints"


def is_step_dir(path: Path) -> bool:
    return _STEP_DIR.match(path.name) is not None


def step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def complete_checkpoints(outdir: Path) -> list[Path]:
    """Finished checkpoints, oldest first (temporary folders of interrupted saves ignored)."""
    root = checkpoint_dir(outdir)
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()
             and not p.is_symlink()] if root.is_dir() else []
    return sorted(found, key=step_of)


def run_id_of(path: Path) -> str | None:
    try:
        return read_json_capped(path / MANIFEST).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def prunable(checkpoints: list[Path], run_id: str, keep: int, just_saved: Path) -> list[Path]:
    """This run's checkpoints beyond the newest `keep`; never another run's, never
    `just_saved`."""
    ours = [p for p in checkpoints if run_id_of(p) == run_id and p != just_saved]
    return ours[:max(0, len(ours) - (keep - 1))]
