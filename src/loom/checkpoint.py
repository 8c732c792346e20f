"""Distributed checkpoints: complete or absent, never half-written, never unpickling code.

A save writes `checkpoints/.step-N.tmp/` on every rank, then rank 0 renames it to `step-N`
once all ranks are done, so a job killed mid-save leaves the previous checkpoint as the
latest. Model and optimizer go through torch.distributed.checkpoint (resharded on load to
any mesh); loop state and RNG states are JSON. DCP's metadata file is a pickle, so it is
read with an unpickler that only admits DCP's own metadata classes.
"""

from __future__ import annotations

import json
import logging
import pickle
import random
import re
import shutil
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from loom.config import ConfigError

logger = logging.getLogger("loom")

_STEP_DIR = re.compile(r"^step-(\d+)$")
_SAFE_GLOBALS = {
    "torch.distributed.checkpoint.metadata": None,  # every class of DCP's metadata module
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "tuple", "list", "dict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = _SAFE_GLOBALS.get(module, set())
        is_torch_type = module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), torch.dtype))
        if is_torch_type or (module in _SAFE_GLOBALS and (allowed is None or name in allowed)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, "
                                     "which is not a checkpoint metadata type")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with a restricted unpickler for the metadata file."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


@dataclass
class LoopState:
    """Where training stands; enough to continue with the next unseen batch."""

    step: int = 0
    tokens_seen: int = 0
    samples_seen: int = 0
    """Global samples consumed: the data position, independent of the dp layout."""


def checkpoint_dir(outdir: Path) -> Path:
    return outdir / "checkpoints"


def complete_checkpoints(outdir: Path) -> list[Path]:
    """Finished checkpoints, oldest first (temporary folders of interrupted saves ignored)."""
    root = checkpoint_dir(outdir)
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name)] if root.is_dir() else []
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def resolve_resume(resume: str | None, outdir: Path) -> Path | None:
    """`auto`: the latest complete checkpoint in the run folder (None if there is none);
    anything else must be a checkpoint folder."""
    if resume is None:
        return None
    if resume == "auto":
        found = complete_checkpoints(outdir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / ".metadata").is_file() or not (path / "loop.json").is_file():
        raise ConfigError(f"--resume {resume}: not a complete loom checkpoint folder")
    return path


def _rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


class Checkpointer:
    """Saves every `interval` steps (and at the end), keeps the newest `keep`, loads any."""

    def __init__(self, outdir: Path, interval: int, keep: int, async_save: bool, rank: int):
        self.root = checkpoint_dir(outdir)
        self.interval, self.keep, self.async_save, self.rank = interval, keep, async_save, rank
        self._pending: tuple[Future, Path, Path] | None = None
        self.last_save_seconds = 0.0

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def due(self, step: int) -> bool:
        return self.enabled and step % self.interval == 0

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             extra: dict[str, Any]) -> None:
        """Write step-N through a temporary folder; with async, the rename happens when the
        next save starts or at `finish()`."""
        self.finish()
        final, tmp = self.root / f"step-{step}", self.root / f".step-{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        (tmp / f"rng-{self.rank}.json").write_text(json.dumps(_rng_state()))
        if self.rank == 0:
            (tmp / "loop.json").write_text(json.dumps(extra, indent=2))
        if self.async_save:
            self._pending = (dcp.async_save(state, checkpoint_id=tmp), tmp, final)
        else:
            dcp.save(state, checkpoint_id=tmp)
            self._commit(tmp, final)

    def finish(self) -> None:
        """Wait for an asynchronous save and publish it."""
        if self._pending is not None:
            future, tmp, final = self._pending
            self._pending = None
            future.result()
            self._commit(tmp, final)

    def _commit(self, tmp: Path, final: Path) -> None:
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            for old in complete_checkpoints(self.root.parent)[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
            for stale in self.root.glob(".step-*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            logger.info("checkpoint saved: %s", final)
        dist.barrier()

    @staticmethod
    def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
             rank: int) -> dict[str, Any]:
        """Load model and optimizer (resharded to this mesh) and this rank's RNG state;
        returns the loop state written by rank 0."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, storage_reader=SafeFileSystemReader(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        rng = path / f"rng-{rank}.json"
        if rng.is_file():
            _set_rng_state(json.loads(rng.read_text()))
        return json.loads((path / "loop.json").read_text())


def loop_state_dict(loop: LoopState, **extra: Any) -> dict[str, Any]:
    return {**asdict(loop), **extra}
