"""The transformers family's parallel plan: a Hugging Face model sharded by the one recipe.

Its plan (`transformers_plan`, registered in loom/families.py) has no TP (config
resolution forced tp to 1), the model's own gradient-checkpointing switch for --ac,
per-block compile, one FSDP2 unit per decoder block, then the root (which keeps tied
embedding and output weights together).
"""

from __future__ import annotations

from torch import nn

from loom.config import ConfigError
from loom.models.spec import ModelPlan
from loom.models.transformers.model import HFCausalLM


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
