"""transformers' own modules, for architectures no native family serves: FSDP/HSDP, the
model's own activation checkpointing and per-block compile; no tensor, pipeline, context or
expert parallelism (their plans name a native family's modules)."""

from __future__ import annotations

from loom.config import ModelConfig
from loom.models.spec import ModelPlan, ModelSpec
from loom.models.transformers.model import HFCausalLM, hf_model_from_config
from loom.parallel.hf import apply_hf_ac, decoder_blocks


def transformers_plan(model: HFCausalLM) -> ModelPlan:
    """Its decoder blocks, its own checkpointing, no TP, and blocks compiled without
    fullgraph (a graph break in code loom does not own costs speed, not the run)."""
    return ModelPlan(model, decoder_blocks(model), f"Hugging Face {type(model.hf).__name__}",
                     attention=None, own_ac=lambda: apply_hf_ac(model), fullgraph=False)


def same_config(m: ModelConfig) -> ModelConfig:
    return m


TRANSFORMERS = ModelSpec(
    name="transformers", model_cls=HFCausalLM, args_from_config=same_config,
    build=hf_model_from_config, plan=transformers_plan, parts=None,
    description="transformers' module of the checkpoint's architecture")

LIMITS = ("tensor, pipeline, context and expert parallel, SimpleFSDP, the fused-linear loss "
          "and `loom plan`")
"""What the transformers path cannot do, for the one info line that says so."""
