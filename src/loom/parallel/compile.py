"""Per-block (or, under SimpleFSDP, whole-model) torch.compile and the partitioner's
activation memory budget.

Blocks are compiled one by one rather than the whole model: the TP embedding's output
redistribution breaks Dynamo, and identical blocks share one graph, so compile cost does
not grow with depth.

Routed experts and expert parallel's dispatch and combine are compiled with their block.
Their row counts are data-dependent: the all-to-all splits and the fp32 loop's chunk sizes
come from `.tolist()`, which Dynamo captures as unbacked sizes once
`capture_scalar_outputs` is on (`compiler_settings`, the one place loom declares Dynamo
options; the run applies them for its duration, `loom.runtime.scope`). Where the graph
breaks:

- Without EP (either strategy) and under SimpleFSDP with EP: nowhere. The block (SimpleFSDP:
  the whole model) is one full graph, routed experts, all-to-all and (SimpleFSDP) the
  expert-weight gathers included.
- FSDP2 with EP: the routed experts are an FSDP2 unit of their own and FSDP2's forward
  hooks refuse tracing (`torch.compiler.disable`), so those blocks compile with
  `fullgraph=False` and break at the experts' call: a graph up to the MoE layer, one for
  the router and the token sort, then, between FSDP2's eager hooks, one each for the
  dispatch, the experts and the combine, then one for the weighted sum and shared experts
  and one for the residual. Every other block stays fullgraph.
- FSDP2 with EP and activation checkpointing: the routed experts (and their all-to-all)
  stay eager and the run says so in one line: the graph break above would fall inside the
  checkpointed region, which Dynamo takes only whole. (SimpleFSDP with `--ac selective`
  under compile fails upstream on torch 2.12-2.14 for every model, MoE or not; validation
  refuses it. `--ac block` and `op` run: each compiled block is checkpointed whole.)
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch._functorch.config as functorch_config  # the attribute exists only once imported
from torch import nn

from loom.config import ParallelConfig
from loom.models.registry import named_part
from loom.models.spec import ModelPlan, ModelSpec
from loom.runtime.scope import GlobalSettings

logger = logging.getLogger("loom")


def compiler_settings(cfg: ParallelConfig) -> GlobalSettings:
    """The process-wide compiler options every compiled region of a run relies on, declared
    here only; read when a graph compiles (at its first step), so the run keeps them in
    force throughout (`loom.runtime.scope.applied`). Nothing without --compile.

    - `capture_scalar_outputs`: `.tolist()` and `.item()` become unbacked symbolic sizes
      instead of graph breaks, so the data-dependent expert splits (EP's all-to-all, the
      fp32 per-expert loop) trace.
    - `activation_memory_budget`: the fraction of the default saved activations the min-cut
      partitioner may keep (1.0 = all); below 1 it recomputes the cheapest ops in backward.
    - `unsafe_treat_script_objects_as_zero_size`: TP graphs carry the DeviceMesh as an
      opaque object the partitioner cannot size; it holds no activations, so counting it as
      zero is exact (the flag only affects size estimates; torch 2.11 has no such flag).
    """
    if not cfg.compile:
        return GlobalSettings()
    options: dict[str, Any] = {
        "torch._dynamo.config.capture_scalar_outputs": True,
        "torch._functorch.config.activation_memory_budget": cfg.act_mem_budget}
    if hasattr(functorch_config, "unsafe_treat_script_objects_as_zero_size"):
        options["torch._functorch.config.unsafe_treat_script_objects_as_zero_size"] = True
    return GlobalSettings(compiler=options, fresh_dynamo=True)


def compile_kwargs(mode: str, backend: str) -> dict[str, Any]:
    """Arguments of `Module.compile` for one block; `mode` only means something to inductor."""
    return dict(backend=backend, fullgraph=True,
                mode=mode if backend == "inductor" and mode != "default" else None)


def _own_storage(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.clone() if output._base is not None else output


def prepare_compile(model: nn.Module, spec: ModelSpec | None = None) -> None:
    """What every compiled-block recipe needs besides the compile calls and the run's
    `compiler_settings`.

    Under TP the embedding returns a view of a collective's result (`to_local`); a compiled
    block given such a view as input drops its gradient (the embedding's gradient came out
    zero), so the embedding output gets its own storage first.
    """
    embedding = named_part(model, "embedding") if spec is None else spec.embedding(model)
    if embedding is not None:  # absent on later pipeline stages
        embedding.register_forward_hook(_own_storage)


def compile_targets(module: nn.Module, eager: set[nn.Module]) -> list[nn.Module]:
    """`module` itself if nothing inside it must stay eager, else its children's targets."""
    if module in eager:
        return []
    if not any(m in eager for m in module.modules()):
        return [module]
    return [t for child in module.children() for t in compile_targets(child, eager)]


def apply_compile(plan: ModelPlan, mode: str, backend: str = "inductor",
                  whole_model: bool = False, expert_parallel: bool = False,
                  checkpointed: bool = False) -> None:
    """Compile each block in place, so state-dict keys do not change (wrapping would add
    `_orig_mod.`). `whole_model`: the data-parallel wrapper lives in the graph (SimpleFSDP),
    so the model compiles as one graph; otherwise it is FSDP2, whose hooks around EP's expert
    units break a MoE block's graph, and with `checkpointed` (activation checkpointing) leave
    the routed experts eager (see the module docstring). The caller keeps the run's
    `compiler_settings` in force while the graphs compile, at the first step."""
    prepare_compile(plan.model, plan.spec)
    kwargs = {**compile_kwargs(mode, backend), "fullgraph": plan.fullgraph}
    experts = set(plan.experts) if expert_parallel else set()
    hooked = set() if whole_model else experts
    eager = hooked if checkpointed else set()
    broken = hooked - eager
    roots = [plan.model] if whole_model else plan.blocks()
    targets = [t for root in roots for t in compile_targets(root, eager)]
    for target in targets:
        holds_experts = any(m in broken for m in target.modules())
        target.compile(**{**kwargs, "fullgraph": kwargs["fullgraph"] and not holds_experts})
    what = ("the whole model" if roots == [plan.model] else f"{len(roots)} blocks"
            if targets == roots else f"{len(targets)} modules of {len(roots)} blocks")
    logger.info("compiled %s (%s, mode %s, activation memory budget %.2f)", what, backend,
                kwargs["mode"] or "default", functorch_config.activation_memory_budget)
    if eager:
        logger.warning("--compile with --ep and --ac under FSDP2: routed experts (and their "
                       "all-to-all) run eagerly, FSDP2's hooks around them would break the "
                       "graph inside the checkpointed block; the rest is compiled")
    elif broken:
        logger.info("--compile with --ep under FSDP2: routed experts and their all-to-all "
                    "are compiled, in graphs of their own between FSDP2's hooks")
