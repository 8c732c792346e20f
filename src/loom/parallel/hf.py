"""Hugging Face models: resolved once per node, then sharded by the one recipe.

Their plan (`transformers_plan`, registered in parallel/families.py) has no TP (config
resolution forced tp to 1), the model's own gradient-checkpointing switch for --ac,
per-block compile, one FSDP2 unit per decoder block, then the root (which keeps tied
embedding and output weights together).
"""

from __future__ import annotations

from torch import nn

from loom.config import ConfigError, JobConfig
from loom.data.loaders import on_node_leaders
from loom.models.spec import ModelPlan
from loom.models.transformers.model import HFCausalLM, load_hf_config, with_hf_config


def resolve_hf_model(cfg: JobConfig, local_rank: int) -> JobConfig:
    """`cfg` with the HF model's shape (no-op for loom's models). Each node's first rank
    checks the source and fetches the config while the others wait, so every rank fails
    together, with one line, when the model cannot be had."""
    if not cfg.model.runs_transformers:
        return cfg
    on_node_leaders(lambda: load_hf_config(cfg.model), leader=local_rank == 0)
    return with_hf_config(cfg, load_hf_config(cfg.model, cached=True))


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The decoder's block list: of the ModuleLists not nested in another one (which drops
    an MoE layer's expert list), the one holding the most parameters (a vision tower's
    blocks lose to the language model's)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    outer = [m for name, m in lists
             if not any(name.startswith(f"{other}.") for other, _ in lists)]
    if not outer:
        raise ValueError(f"{type(model).__name__} has no list of decoder blocks to shard")
    return max(outer, key=lambda m: sum(p.numel() for p in m.parameters()))


def apply_hf_ac(model: HFCausalLM) -> None:
    """The model's own activation checkpointing, which recomputes each decoder block in
    backward; non-reentrant, which composes with FSDP2's hooks and compiled blocks.
    transformers 5 renamed `gradient_checkpointing_enable`; the old name warns there."""
    hf, kwargs = model.hf, {"use_reentrant": False}
    if not hf.supports_gradient_checkpointing:
        raise ConfigError(f"{type(hf).__name__} has no activation checkpointing; drop --ac")
    if hasattr(hf, "activation_checkpointing_enable"):
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def transformers_plan(model: HFCausalLM) -> ModelPlan:
    """Its decoder blocks, its own checkpointing, no TP, and blocks compiled without
    fullgraph (a graph break in code loom does not own costs speed, not the run)."""
    return ModelPlan(model, decoder_blocks(model), f"Hugging Face {type(model.hf).__name__}",
                     attention=None, own_ac=lambda: apply_hf_ac(model), fullgraph=False)
