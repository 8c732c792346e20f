"""A Hugging Face safetensors folder read through a family's adapter, one tensor at a time.

The folder is checked against the model its config.json describes before any weight is
read: every tensor the adapter needs exists, in a shard that exists, with the shape the
model expects once converted. Nothing in the folder runs (safetensors is data; the index
is JSON read with a size cap).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loom.config import ConfigError
from loom.models.spec import HFAdapter
from loom.safe_io import read_json_capped

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def shard_map(folder: Path) -> dict[str, Path]:
    """Tensor name -> the shard file holding it, from the index or the single file."""
    from safetensors import safe_open  # optional dependency (the hf extra)

    if (folder / INDEX).is_file():
        try:
            weight_map = read_json_capped(folder / INDEX)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{folder / INDEX} is unusable ({e})") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ConfigError(f"{folder / INDEX}: weight_map is not a map of names to files")
        files = {name: folder / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if file.parent != folder or not file.is_file():
                raise ConfigError(f"{folder}: shard {file.name} named by its index is missing "
                                  "(or lies outside the folder)")
        return files
    if (folder / SINGLE).is_file():
        with safe_open(str(folder / SINGLE), "pt") as f:
            return dict.fromkeys(f.keys(), folder / SINGLE)
    raise ConfigError(f"{folder} holds no safetensors weights ({SINGLE} or {INDEX}); only "
                      "safetensors are read (pickled .bin files can run code)")


class HFCheckpoint:
    """Reads loom's tensors, by loom name, from a Hugging Face folder."""

    def __init__(self, folder: Path, adapter: HFAdapter, args: Any):
        self.folder, self.sources = folder, adapter.sources(args)
        self.files = shard_map(folder)

    def check(self, model: nn.Module, clean: Callable[[str], str]) -> None:
        """Every parameter of `model` (meta is fine) has its source tensors, shaped so that
        the conversion gives the parameter's shape; else one ConfigError naming the first
        that does not."""
        from safetensors import safe_open  # optional dependency (the hf extra)

        for raw, param in model.named_parameters():
            name = clean(raw)
            if name not in self.sources:
                raise ConfigError(f"{self.folder}: nothing in the adapter fills {name}")
            theirs, convert = self.sources[name]
            shapes = []
            for hf_name in theirs:
                if hf_name not in self.files:
                    raise ConfigError(f"{self.folder}: tensor {hf_name} is missing")
                with safe_open(str(self.files[hf_name]), "pt") as f:
                    shapes.append(tuple(f.get_slice(hf_name).get_shape()))
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
            with safe_open(str(self.files[hf_name]), "pt", device="cpu") as f:
                tensors.append(f.get_tensor(hf_name).float())
        return convert(*tensors).contiguous()
