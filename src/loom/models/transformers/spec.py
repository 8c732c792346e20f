"""transformers' own modules, for architectures no native family serves: FSDP/HSDP, the
model's own activation checkpointing and per-block compile; no tensor, pipeline, context or
expert parallelism (their plans name a native family's modules)."""

from __future__ import annotations

from loom.config import ModelConfig
from loom.models.llama.model import ModelArgs
from loom.models.llama.spec import dense_args
from loom.models.spec import ModelSpec
from loom.models.transformers.model import HFCausalLM, hf_model_from_config


def same_config(m: ModelConfig) -> ModelConfig:
    return m


def recorded_args(m: ModelConfig) -> ModelArgs:
    """What a checkpoint records of a transformers-path model: loom's dense fields, filled
    from its config (its shape)."""
    return dense_args(m)


TRANSFORMERS = ModelSpec(
    name="transformers", model_cls=HFCausalLM, args_from_config=same_config,
    build=hf_model_from_config, parts=None, uses=frozenset(),
    description="transformers' module of the checkpoint's architecture")

LIMITS = ("tensor, pipeline, context and expert parallel, SimpleFSDP, the fused-linear loss "
          "and `loom plan`")
"""What the transformers path cannot do, for the one info line that says so."""
