"""Activation checkpointing: recompute each block (or only its attention) in backward.

Uses torch's non-reentrant `checkpoint_wrapper`: a module wrapper that composes with TP
and FSDP2 and that Dynamo traces as a checkpoint region, so per-block compile sees through
it (the hook-based `torch.distributed._composable.checkpoint` breaks a fullgraph compile).
The wrapper strips its `_checkpoint_wrapped_module.` prefix from state-dict keys.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from loom.models.spec import ModelPlan

logger = logging.getLogger("loom")


def checkpointed(module: nn.Module) -> nn.Module:
    """`module` recomputed in backward; RNG state is restored first, so random ops (dropout)
    recompute the same values as in forward."""
    return checkpoint_wrapper(module, preserve_rng_state=True)


def apply_ac(plan: ModelPlan, mode: str) -> int:
    """'block': wrap every block; 'selective': wrap every block's attention child; a model
    with checkpointing of its own (Hugging Face) uses that for either. Returns how many
    modules were wrapped (or, for the model's own, recompute)."""
    if mode == "none":
        return 0
    if mode not in ("block", "selective"):
        raise ValueError(f"unknown activation checkpoint mode {mode!r}")
    if plan.own_ac is not None:
        plan.own_ac()
        logger.info("activation checkpointing: the model's own, %d blocks recomputed",
                    len(plan.blocks()))
        return len(plan.blocks())
    wrapped = 0
    for name, block in list(plan.layers.named_children()):
        if mode == "block":
            plan.layers.register_module(name, checkpointed(block))
        elif plan.attention and isinstance(getattr(block, plan.attention, None), nn.Module):
            block.register_module(plan.attention, checkpointed(getattr(block, plan.attention)))
        else:
            continue
        wrapped += 1
    what = "blocks" if mode == "block" else "attention modules"
    if wrapped == 0:
        logger.warning("activation checkpointing (%s): found no %s to wrap; nothing is "
                       "recomputed", mode, what)
    else:
        logger.info("activation checkpointing (%s): wrapped %d %s", mode, wrapped, what)
    return wrapped
