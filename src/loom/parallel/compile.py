"""Per-block torch.compile and the partitioner's activation memory budget."""

from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger("loom")


def apply_compile(model: nn.Module, mode: str, act_mem_budget: float) -> None:
    """Compile each block in place (state-dict keys unchanged), fullgraph so a graph break
    is an error rather than a silent slowdown."""
    import torch._functorch.config as functorch_config

    functorch_config.activation_memory_budget = act_mem_budget
    compile_mode = None if mode == "default" else mode
    for block in model.layers.values():
        block.compile(fullgraph=True, mode=compile_mode)
    logger.info("compiled %d blocks (mode %s, activation memory budget %.2f)",
                len(model.layers), mode, act_mem_budget)

