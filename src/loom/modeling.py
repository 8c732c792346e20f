"""The model a config describes: its arguments, taken from the config fields of the same
name (never copied by hand), and the unparallelized module."""

from __future__ import annotations

from dataclasses import fields

from torch import nn

from loom.config import JobConfig
from loom.models.hf import hf_model_from_config, is_hf
from loom.models.llama import ModelArgs, Transformer
from loom.models.moe import MoEArgs, MoETransformer


def model_args(cfg: JobConfig) -> ModelArgs:
    """The arguments of loom's model: MoEArgs when --n-experts > 0, else ModelArgs; each
    field comes from the config field of the same name."""
    cls = MoEArgs if cfg.model.n_experts else ModelArgs
    return cls(**{f.name: getattr(cfg.model, f.name) for f in fields(cls)})


def plain_model(cfg: JobConfig) -> nn.Module:
    """The unparallelized model on the current device: dense, or MoE when --n-experts > 0
    (a Hugging Face --model: its architecture with fresh weights)."""
    if is_hf(cfg.model):
        return hf_model_from_config(cfg.model)
    args = model_args(cfg)
    return MoETransformer(args) if isinstance(args, MoEArgs) else Transformer(args)
