"""The one ordered recipe for every model: TP (and EP) -> CP -> activation checkpointing ->
compile -> the data-parallel wrapper, each step driven by the model's plan (compile before
checkpointing where the torch in use fails a checkpoint inside a compiled DTensor graph)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from loom.compat import checkpoint_inside_compile_saves_mesh
from loom.config import ParallelConfig
from loom.numerics.precision import describe
from loom.parallel.checkpointing import apply_ac
from loom.parallel.compile import apply_compile
from loom.parallel.context import apply_cp, sum_over_cp
from loom.parallel.fsdp import apply_fsdp
from loom.parallel.mesh import ParallelDims
from loom.parallel.model_plan import ModelPlan, model_plan
from loom.parallel.simple_fsdp import apply_simple_fsdp
from loom.parallel.single import apply_single_device, runs_plain

logger = logging.getLogger("loom")


@dataclass(frozen=True)
class DataParallelStrategy:
    wrap: Callable[[ModelPlan, ParallelDims, ParallelConfig, str], str]
    """Shards the planned model in place; returns what it did, for the log line."""
    whole_graph: bool
    """Whether compile may take the whole model as one graph (the gathers are in it)."""


STRATEGIES = {"fsdp2": DataParallelStrategy(apply_fsdp, whole_graph=False),
              "simple-fsdp": DataParallelStrategy(apply_simple_fsdp, whole_graph=True)}
SINGLE_DEVICE = DataParallelStrategy(apply_single_device, whole_graph=True)
"""One process (`loom.parallel.single`): no wrapper, so nothing splits the compiled graph."""


def refreeze(model: nn.Module, frozen: set[str]) -> None:
    """Freeze the named parameters again: torch's SequenceParallel re-creates a norm's
    weight as a new Parameter that requires grad, whatever the old one did (a model
    converter such as LoRA freezes weights before tensor parallel)."""
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


def checkpoint_outside_compile(dims: ParallelDims, cfg: ParallelConfig) -> bool:
    """Whether blocks are compiled first and then checkpointed (AC around the compiled
    block) instead of checkpointed inside the compiled graph: only where this torch fails
    the usual order (`loom.compat.checkpoint_inside_compile_saves_mesh`) and a DTensor
    redistribution sits inside the block (tp, SimpleFSDP's gathers). Blocks are then
    compiled one by one, also under SimpleFSDP (its gathers stay in each block's graph)."""
    return (cfg.compile and cfg.activation_checkpoint in ("block", "op")
            and (dims.tp_enabled or cfg.data_parallel == "simple-fsdp")
            and checkpoint_inside_compile_saves_mesh())


def parallelize(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig, *,
                loss_parallel: bool, backend: str) -> nn.Module:
    """Apply every enabled parallelism to a model, in place: a meta-device one gets meta
    shards (to be materialised and filled), a CPU-resident one real shards."""
    plan = model_plan(model)  # carries the family's spec: no further lookup below
    if plan.tensor_parallel is not None:
        frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
        plan.tensor_parallel(dims, loss_parallel)
        refreeze(model, frozen)
    elif dims.tp_enabled:
        raise ValueError(f"{type(model).__name__} runs at tp 1 (config resolution forces it)")
    if dims.tp_enabled:
        logger.info("tensor parallel: tp=%d, sequence parallel, %s logits", dims.tp,
                    "vocab-sharded" if loss_parallel else "replicated")
    if dims.cp_enabled:  # context parallel: attention cores swapped, RoPE by global position
        apply_cp(model, dims.get_mesh("cp"), dims.tp, parts=plan.spec.parts)
        if plan.context_parallel is not None:
            plan.context_parallel(sum_over_cp(dims.get_mesh("cp")))
    strategy = SINGLE_DEVICE if runs_plain(dims, cfg) else STRATEGIES[cfg.data_parallel]
    outside = checkpoint_outside_compile(dims, cfg)
    if not outside:
        apply_ac(plan, cfg.activation_checkpoint)
    if cfg.compile:
        apply_compile(plan, cfg.compile_mode, cfg.compile_backend,
                      whole_model=strategy.whole_graph and not outside,
                      expert_parallel=dims.ep_enabled,
                      checkpointed=cfg.activation_checkpoint != "none")
    if outside:
        apply_ac(plan, cfg.activation_checkpoint)
        logger.info("--compile with --ac under %s on torch %s: each compiled block is "
                    "checkpointed whole (this torch fails a checkpoint inside the graph)",
                    "tp" if dims.tp_enabled else "SimpleFSDP", torch.__version__)
    done = strategy.wrap(plan, dims, cfg, backend)
    if strategy is not SINGLE_DEVICE:  # which names its own precision: nothing is reduced
        done = f"{done}, {describe(cfg.dtype, cfg.reduce_dtype)}"
    logger.info("%s: %d blocks, AC %s, compile %s; %s", plan.name, len(plan.blocks()),
                cfg.activation_checkpoint, cfg.compile_backend if cfg.compile else "off", done)
    return model
