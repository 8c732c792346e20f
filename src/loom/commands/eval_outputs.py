"""Where `loom eval` writes: `--outdir` as given, else a folder of the run that saved the
checkpoint, found from the checkpoint's resolved path (a link, `.` or a relative path
names the same run; a step folder copied out of its run has none, and needs --outdir).
Never the run folder itself (its config.json is the run's), the checkpoint, or a folder
inside `checkpoints/`; never a link or a file."""

from __future__ import annotations

from pathlib import Path

from loom.config import ConfigError
from loom.runtime.outputs import output_folder


def run_of(checkpoint: Path) -> Path | None:
    """The run folder holding `checkpoint` (`<run>/checkpoints/step-N`, resolved), or None
    for a step folder outside any run."""
    resolved = checkpoint.resolve()
    return resolved.parent.parent if resolved.parent.name == "checkpoints" else None


def eval_folder(checkpoint: Path, given: str | None, name: str) -> Path:
    """The checked results folder: `given` (--outdir), else `<run>/<name>`. Files are
    added to it under new names, so it may hold earlier results."""
    resolved = checkpoint.resolve()
    run = run_of(checkpoint)
    keep = [resolved] if run is None else [resolved, run]
    inside = [resolved.parent if resolved.parent.name == "checkpoints" else resolved]
    if given is not None:
        return output_folder(given, "--outdir", nonempty_ok=True, keep=keep, inside=inside)
    if run is None:
        raise ConfigError(f"loom eval: {checkpoint} is not inside a run folder "
                          "(<run>/checkpoints/step-N), so there is no run folder for the "
                          "results: pass --outdir")
    return output_folder(run / name, "loom eval's results folder", nonempty_ok=True,
                         keep=keep, inside=inside)
