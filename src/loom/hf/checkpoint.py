"""A Hugging Face safetensors folder read through a family's adapter, one tensor at a time.

The folder is checked against the model its config.json describes before any weight is
read: its headers and index by `loom.models.hf_folder` (the one reader of such folders),
then every tensor the adapter needs exists with the shape the model expects once
converted. Nothing in the folder runs (safetensors is data; the index is JSON read with a
size cap).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loom.config import ConfigError
from loom.models.hf_folder import read_weights
from loom.models.spec import HFAdapter

logger = logging.getLogger("loom")


class HFCheckpoint:
    """Reads loom's tensors, by loom name, from a Hugging Face folder."""

    def __init__(self, folder: Path, adapter: HFAdapter, args: Any):
        self.folder, self.tensors = folder, read_weights(folder)
        # optional adapter parts: modules a folder may lack wholly, and lines about them
        absent = getattr(adapter, "absent_modules", None)
        notes = getattr(adapter, "notes", None)
        self.fresh: tuple[str, ...] = absent(args, self.tensors) if absent else ()
        """loom prefixes of the modules the folder holds nothing of: initialised, not read."""
        self.notes: list[str] = notes(args, self.tensors) if notes else []
        self.sources = {name: source for name, source in adapter.sources(args).items()
                        if not name.startswith(self.fresh)}

    def check(self, model: nn.Module, clean: Callable[[str], str]) -> None:
        """Every parameter of `model` (meta is fine) has its source tensors, shaped so that
        the conversion gives the parameter's shape; else one ConfigError naming the first
        that does not. The adapter's notes (a module initialised fresh, one left out) are
        logged, once per job: only global rank 0 checks."""
        for note in self.notes:
            logger.warning("%s: %s", self.folder, note)
        for raw, param in model.named_parameters():
            name = clean(raw)
            if name.startswith(self.fresh):
                continue
            if name not in self.sources:
                raise ConfigError(f"{self.folder}: nothing in the adapter fills {name}")
            theirs, convert = self.sources[name]
            shapes = []
            for hf_name in theirs:
                if hf_name not in self.tensors:
                    raise ConfigError(f"{self.folder}: tensor {hf_name} is missing")
                shapes.append(self.tensors[hf_name].shape)
            converted = convert(*(torch.empty(s, device="meta") for s in shapes))
            if tuple(converted.shape) != tuple(param.shape):
                raise ConfigError(f"{self.folder}: tensor {theirs[0]} has shape "
                                  f"{list(shapes[0])}, but its config.json makes {name} "
                                  f"{list(param.shape)}")

    def read(self, name: str) -> torch.Tensor:
        """loom's full tensor `name` in fp32; each source file is opened per tensor, so no
        memory-mapped page stays resident beyond it."""
        from safetensors import safe_open  # optional dependency (the hf extra)

        theirs, convert = self.sources[name]
        tensors = []
        for hf_name in theirs:
            with safe_open(str(self.tensors[hf_name].file), "pt", device="cpu") as f:
                tensors.append(f.get_tensor(hf_name).float())
        return convert(*tensors).contiguous()
