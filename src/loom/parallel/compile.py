"""Per-block torch.compile and the partitioner's activation memory budget.

Blocks are compiled one by one rather than the whole model: the TP embedding's output
redistribution breaks Dynamo, and identical blocks share one graph, so compile cost does
not grow with depth. Routed experts stay eager: their row counts are data-dependent
(host-side splits for the all-to-all and the fp32 loop) and under EP they are an FSDP unit
of their own, none of which a full graph can capture.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch._functorch.config as functorch_config  # the attribute exists only once imported
from torch import nn

from loom.models.registry import named_part
from loom.models.spec import ModelPlan

logger = logging.getLogger("loom")


def set_act_mem_budget(budget: float) -> None:
    """Fraction of the default saved activations the min-cut partitioner may keep (1.0 = all);
    below 1 it recomputes the cheapest ops in backward. Process-wide, read at compile time."""
    functorch_config.activation_memory_budget = budget
    # TP graphs carry the DeviceMesh as an opaque object the partitioner cannot size; it holds
    # no activations, so counting it as zero is exact (the flag only affects size estimates;
    # torch 2.11 has no such flag).
    if hasattr(functorch_config, "unsafe_treat_script_objects_as_zero_size"):
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
    embedding = named_part(model, "embedding")
    if embedding is not None:  # absent on later pipeline stages
        embedding.register_forward_hook(_own_storage)


def compile_targets(module: nn.Module, eager: set[nn.Module]) -> list[nn.Module]:
    """`module` itself if nothing inside it must stay eager, else its children's targets."""
    if module in eager:
        return []
    if not any(m in eager for m in module.modules()):
        return [module]
    return [t for child in module.children() for t in compile_targets(child, eager)]


def apply_compile(plan: ModelPlan, mode: str, act_mem_budget: float, backend: str = "inductor",
                  whole_model: bool = False) -> None:
    """Compile each block in place, so state-dict keys do not change (wrapping would add
    `_orig_mod.`): of a block holding routed experts, everything around them. `whole_model`
    (SimpleFSDP): one graph for the model where no module must stay eager."""
    prepare_compile(plan.model, act_mem_budget)
    kwargs = {**compile_kwargs(mode, backend), "fullgraph": plan.fullgraph}
    eager = set(plan.experts)
    roots = [plan.model] if whole_model and not eager else plan.blocks()
    targets = [t for root in roots for t in compile_targets(root, eager)]
    for target in targets:
        target.compile(**kwargs)
    what = ("the whole model" if roots == [plan.model] else f"{len(roots)} blocks"
            if targets == roots else f"{len(targets)} modules of {len(roots)} blocks")
    logger.info("compiled %s (%s, mode %s, activation memory budget %.2f)", what, backend,
                kwargs["mode"] or "default", act_mem_budget)
    if eager:
        logger.warning("--compile on a MoE model: routed experts (and their all-to-all) run "
                       "eagerly, data-dependent splits cannot be captured; the rest is compiled")
