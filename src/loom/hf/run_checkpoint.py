"""What a run's checkpoint holds, read in this one process: its model, tensors and run config.

`loom export`, `loom generate` and `loom eval` all start from a checkpoint folder: this
module verifies it, names the family and arguments of its model, checks before anything is
allocated that the model it describes fits its data files and the host, and reads its
tensors with loom's pickle-free reader (a LoRA run's frozen base from the run's source).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from loom.checkpoint.format import DATA_FILE, TensorReader
from loom.checkpoint.model_record import rebuilt_args
from loom.checkpoint.trust import UnusableCheckpoint, read_loop, verify_checkpoint
from loom.config import ConfigError, ModelConfig
from loom.data.tokenizers import tokenizer_name
from loom.hf.lora_base import check_base
from loom.hf.peft import Read, base_reader
from loom.lora.converter import LoraSettings, apply_lora
from loom.models.registry import family
from loom.models.spec import ModelSpec
from loom.models.transformers.model import hf_model_from_config
from loom.runtime.preflight import check_host_fits
from loom.safe_io import read_json_capped

HOST_COPIES = 3
"""Copies of the weights `loom generate` and export's check hold at once (loaded, a second
model, serialised), for the memory check."""


@dataclass(frozen=True)
class RunModel:
    """What a checkpoint holds: its family, the family's arguments and the run's model
    settings (transformers-path runs: the Hugging Face name)."""

    spec: ModelSpec
    args: Any
    model_cfg: ModelConfig
    checkpoint: Path
    lora: LoraSettings | None = None
    """A LoRA run's adapters (the model is built with them)."""
    base: str | None = None
    seed: int = 0
    """A LoRA run's source (its --model) and seed: its checkpoint holds no frozen weight."""
    base_record: str | None = None
    """The base its adapters were trained on (`loom.hf.lora_base`; None: not recorded)."""

    def build(self) -> nn.Module:
        if self.spec.name == "transformers":
            return hf_model_from_config(self.model_cfg, dtype=torch.float32)
        model = self.spec.new(self.args)
        if self.lora is not None:
            apply_lora(model, self.lora)
        return model


def run_model(checkpoint: Path) -> RunModel:
    """Verify a checkpoint and say which model it holds (nothing loaded yet)."""
    manifest = verify_checkpoint(checkpoint)
    loop = read_loop(checkpoint)
    arch = loop["architecture"]  # {family, **args}, checked against the family's dataclass
    if arch["family"] == "transformers":
        settings = run_config(checkpoint).get("model", {})
        model_cfg = ModelConfig(model=arch.get("model"), model_impl="transformers",
                                trust_remote_code=bool(settings.get("trust_remote_code")))
        held = RunModel(family("transformers"), model_cfg, model_cfg, checkpoint)
        check_model_bytes(held, manifest, f"{arch.get('model')}/config.json: the sizes of "
                                          f"the model checkpoint {checkpoint} trained")
        return held
    spec = family(arch["family"])
    try:
        args = rebuilt_args(arch)
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise UnusableCheckpoint(f"checkpoint {checkpoint} is unsafe: loop.json model_args "
                                 f"do not make a {spec.name} model ({e})") from None
    flags = ModelConfig().values()  # the model flags a family's arguments are named after
    model_cfg = ModelConfig().with_values(
        **{k: v for k, v in loop["model_args"].items() if k in flags}, family=spec.name)
    lora = LoraSettings.recorded(arch)
    base = run_config(checkpoint).get("model", {}).get("model") if lora else None
    held = RunModel(spec, args, model_cfg, checkpoint, lora, base,
                    loop["settings"].get("seed", 0), arch.get("lora_base"))
    check_model_bytes(held, manifest, f"checkpoint {checkpoint} is unsafe: loop.json "
                                      "model_args")
    return held


def check_model_bytes(held: RunModel, manifest: dict[str, Any], source: str) -> None:
    """The model that `source` (the checkpoint's `model_args`, or for transformers' module
    the config.json of the folder it trained from) describes is no larger than the
    checkpoint's data files (which hold its fp32 weights), and fits in memory with its
    buffers, before anything is allocated: a crafted `max_seq_len` or `dim` stops here in
    one line."""
    with torch.device("meta"):
        model = held.build()
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
                  or held.lora is None)  # a LoRA checkpoint holds no frozen weight
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    stored = sum(r["bytes"] for name, r in manifest["files"].items() if DATA_FILE.match(name))
    if weights > stored:
        raise UnusableCheckpoint(f"{source} describe {weights:,} bytes of weights, its data "
                                 f"files hold {stored:,}")
    check_host_fits(HOST_COPIES * weights + buffers, f"the model of {held.checkpoint}")


def read_state(checkpoint: Path, state: dict[str, torch.Tensor]) -> None:
    """Fill `state` (names as in the model) from the checkpoint with loom's pickle-free
    reader; only the named tensors are read."""
    try:
        with warnings.catch_warnings():  # its note that it loads in one process: intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": state}, storage_reader=TensorReader(checkpoint), no_dist=True)
    except CheckpointException as e:  # a BaseException: names the first rank's failure
        failure = next(iter(e.failures.values()), (e,))[0]
        reason = f"{type(failure).__name__}: {failure}"
        raise UnusableCheckpoint(f"checkpoint {checkpoint} cannot be loaded: "
                                 f"{' '.join(reason.split())[:300]}") from None


def load_run_model(checkpoint: Path) -> tuple[nn.Module, RunModel]:
    """The checkpoint's whole model in this one process (fp32, training mode); a LoRA
    run's frozen base from the run's source."""
    held = run_model(checkpoint)
    model = held.build()
    state = model.state_dict()
    frozen = frozen_names(model)
    read_state(checkpoint, {n: t for n, t in state.items() if n not in frozen})
    if frozen:
        read_base = frozen_base(held)
        for name in frozen:
            state[name].copy_(read_base(name))
    model.load_state_dict(state)
    return model, held


def frozen_names(model: nn.Module) -> set[str]:
    """The parameters a checkpoint of this (built) model does not hold."""
    return {name for name, p in model.named_parameters() if not p.requires_grad}


def run_reader(held: RunModel, shapes: dict[str, Any]) -> Callable[[str], torch.Tensor]:
    """Each tensor of the run's model by name: from the checkpoint, or for a LoRA run's
    frozen base, from the run's source."""
    saved = reader(held.checkpoint, shapes)
    if held.lora is None:
        return saved
    with torch.device("meta"):
        frozen = frozen_names(held.build())
    base = frozen_base(held)
    return lambda name: base(name) if name in frozen else saved(name)


def frozen_base(held: RunModel) -> Read:
    """A LoRA run's frozen base by name, once its source is checked to hold the base the
    adapters were trained on."""
    check_base(held.base_record, held.base, held.seed, held.checkpoint)
    return base_reader(held.spec, held.args, held.base, held.seed)


def load_model_state(checkpoint: Path) -> tuple[dict[str, torch.Tensor], Any]:
    """The checkpoint's full model state and its family's arguments."""
    model, held = load_run_model(checkpoint)
    return model.state_dict(), held.args


def run_tokenizer(checkpoint: Path) -> str | None:
    """The tokenizer of the run that saved `checkpoint`, from its run folder's config.json
    (None: the shipped one)."""
    settings = run_config(checkpoint)
    return tokenizer_name(settings.get("data", {}).get("tokenizer_name"),
                          settings.get("model", {}).get("model"))


def run_config(checkpoint: Path) -> dict[str, Any]:
    """The `data` and `model` tables of the config.json of the run that saved `checkpoint`
    ({} where there is none); the names in them must be strings or null."""
    config = checkpoint.parent.parent / "config.json"
    if not config.exists() and not config.is_symlink():
        return {}
    try:
        settings = read_json_capped(config)
        tables = {k: settings.get(k, {}) for k in ("data", "model")}
        if not all(isinstance(t, dict) for t in tables.values()) or not all(
                isinstance(t.get(k), str | None) for t, k in
                ((tables["data"], "tokenizer_name"), (tables["model"], "model"))):
            raise ValueError("tokenizer_name or model is not a name")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{config} is unusable ({e}); nothing was written") from None
    return tables



def reader(checkpoint: Path, shapes: dict[str, Any]) -> Callable[[str], torch.Tensor]:
    def read(name: str) -> torch.Tensor:
        state = {name: torch.empty(shapes[name])}
        read_state(checkpoint, state)
        return state[name]

    return read
