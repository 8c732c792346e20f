"""The one ordered recipe: TP -> CP -> EP/ETP -> activation checkpointing -> compile -> FSDP2
(or SimpleFSDP, which compiles after wrapping)."""

from __future__ import annotations

import logging

from torch import nn

from loom.config import ParallelConfig
from loom.mesh import ParallelDims
from loom.parallel.checkpointing import apply_ac
from loom.parallel.compile import apply_compile
from loom.parallel.context import apply_cp
from loom.parallel.expert import (
    apply_expert_fsdp,
    apply_moe_compile,
    apply_moe_parallel,
    moe_layers,
)
from loom.parallel.fsdp import apply_fsdp, mixed_precision, set_gradient_division
from loom.parallel.simple_fsdp import apply_simple_fsdp
from loom.parallel.tensor import apply_tp
from loom.precision import describe

logger = logging.getLogger("loom")


def parallelize_llama(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig, *,
                      loss_parallel: bool, backend: str) -> nn.Module:
    """Apply every enabled parallelism to a meta-device Transformer, in place."""
    if dims.tp_enabled:
        apply_tp(model, dims.get_mesh("tp"), loss_parallel=loss_parallel)
        logger.info("tensor parallel: tp=%d, sequence parallel, %s logits", dims.tp,
                    "vocab-sharded" if loss_parallel else "replicated")
    if dims.cp_enabled:  # context parallel: attention cores swapped, RoPE by global position
        apply_cp(model, dims.get_mesh("cp"))
    apply_moe_parallel(model, dims)
    apply_ac(model, cfg.activation_checkpoint)
    if cfg.data_parallel == "simple-fsdp":
        return apply_simple_fsdp(model, dims, cfg)
    if cfg.compile:
        compile_fn = apply_moe_compile if moe_layers(model) else apply_compile
        compile_fn(model, cfg.compile_mode, cfg.act_mem_budget, cfg.compile_backend)
    fsdp_kwargs = dict(reshard_after_forward=cfg.reshard_after_forward == "always",
                       mp_policy=mixed_precision(cfg.dtype, cfg.reduce_dtype))
    apply_expert_fsdp(model, dims, backend=backend, **fsdp_kwargs)
    units = apply_fsdp(model, dims.fsdp_mesh, **fsdp_kwargs)
    if cfg.grad_divide_factor:
        set_gradient_division(units, dims.loss_size, backend, shard_size=dims.dp_shard * dims.cp)
    logger.info("FSDP2: %d units over %s mesh %s, reshard after forward: %s, %s",
                len(units), "HSDP" if dims.dp_replicate_enabled else "dp_shard",
                tuple(dims.fsdp_mesh.shape), cfg.reshard_after_forward,
                describe(cfg.dtype, cfg.reduce_dtype))
    return model
