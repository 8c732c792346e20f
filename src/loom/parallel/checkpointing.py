"""Activation checkpointing: recompute each block (or its attention) in backward."""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

logger = logging.getLogger("loom")


def apply_ac(model: nn.Module, mode: str) -> int:
    """Wrap each block ('block') or each block's attention ('selective'); returns the count.

    Wrapping keeps RNG state (preserve_rng_state) so dropout-like ops recompute identically,
    and uses the non-reentrant checkpoint that torch.compile can trace through.
    """
    if mode == "none":
        return 0
    wrapped = 0
    for name, block in model.layers.items():
        if mode == "block":
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=True)
            wrapped += 1
        elif mode == "selective" and hasattr(block, "attention"):
            block.attention = checkpoint_wrapper(block.attention, preserve_rng_state=True)
            wrapped += 1
    if wrapped == 0:
        logger.warning("activation checkpoint %r found nothing to wrap", mode)
    else:
        logger.info("activation checkpointing (%s) wrapped %d modules", mode, wrapped)
    return wrapped
