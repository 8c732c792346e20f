"""Per-block torch.compile and the partitioner's activation memory budget.

Blocks are compiled one by one rather than the whole model: the TP embedding's output
redistribution breaks Dynamo, and identical blocks share one graph, so compile cost does
not grow with depth.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch._functorch.config as functorch_config  # the attribute exists only once imported
from torch import nn

logger = logging.getLogger("loom")


def set_act_mem_budget(budget: float) -> None:
    """Fraction of the default saved activations the min-cut partitioner may keep (1.0 = all);
    below 1 it recomputes the cheapest ops in backward. Process-wide, read at compile time."""
    functorch_config.activation_memory_budget = budget
    # TP graphs carry the DeviceMesh as an opaque object the partitioner cannot size; it holds
    # no activations, so counting it as zero is exact (the flag only affects size estimates).
    functorch_config.unsafe_treat_script_objects_as_zero_size = True


def compile_kwargs(mode: str, backend: str) -> dict[str, Any]:
    """Arguments of `Module.compile` for one block; `mode` only means something to inductor."""
    return dict(backend=backend, fullgraph=True,
                mode=mode if backend == "inductor" and mode != "default" else None)


def _own_storage(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.clone() if output._base is not None else output


def prepare_compile(model: nn.Module, act_mem_budget: float) -> None:
    """What every compiled-block recipe needs besides the compile calls.

    Under TP the embedding returns a view of a collective's result (`to_local`); a compiled
    block given such a view as input drops its gradient (the embedding's gradient came out
    zero), so the embedding output gets its own storage first.
    """
    set_act_mem_budget(act_mem_budget)
    if isinstance(getattr(model, "tok_embeddings", None), nn.Module):  # absent on later PP stages
        model.tok_embeddings.register_forward_hook(_own_storage)


def apply_compile(model: nn.Module, mode: str, act_mem_budget: float,
                  backend: str = "inductor") -> None:
    """Compile each block in place, so state-dict keys do not change (wrapping would add
    `_orig_mod.`); fullgraph, so a graph break is an error rather than a silent slowdown."""
    prepare_compile(model, act_mem_budget)
    kwargs = compile_kwargs(mode, backend)
    for block in model.layers.values():
        block.compile(**kwargs)
    logger.info("compiled %d blocks (%s, mode %s, activation memory budget %.2f)",
                len(model.layers), backend, kwargs["mode"] or "default", act_mem_budget)
