"""Activation checkpointing: recompute each block, only its attention, or a block's cheap
ops (`op`: the expensive ops' outputs are saved by a policy) in backward.

Uses torch's non-reentrant `checkpoint_wrapper`: a module wrapper that composes with TP
and FSDP2 and that Dynamo traces as a checkpoint region, so per-block compile sees through
it (the hook-based `torch.distributed._composable.checkpoint` breaks a fullgraph compile).
The wrapper strips its `_checkpoint_wrapped_module.` prefix from state-dict keys.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from loom.models.spec import ModelPlan

logger = logging.getLogger("loom")


def checkpointed(module: nn.Module, context_fn: Callable[[], Any] | None = None) -> nn.Module:
    """`module` recomputed in backward; RNG state is restored first, so random ops (dropout)
    recompute the same values as in forward. `context_fn`: selective checkpointing's
    contexts (which ops' outputs are saved rather than recomputed)."""
    if context_fn is None:
        return checkpoint_wrapper(module, preserve_rng_state=True)
    return checkpoint_wrapper(module, preserve_rng_state=True, context_fn=context_fn)


def _ops(*names: str, namespace: Any = torch.ops.aten) -> frozenset[Any]:
    """The named overloads this torch build has (a CPU-only build lacks some kernels')."""
    found = set()
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(namespace, packet, None)
        if op is not None and hasattr(op, overload or "default"):
            found.add(getattr(op, overload or "default"))
    return frozenset(found)


MATMULS = _ops("mm", "addmm", "bmm")
"""What a linear layer lowers to under the checkpoint's dispatch mode."""
ALWAYS_SAVED = _ops("_scaled_dot_product_flash_attention",
                    "_scaled_dot_product_efficient_attention",
                    "_scaled_dot_product_cudnn_attention",
                    "_scaled_dot_product_flash_attention_for_cpu") | _ops(
    "reduce_scatter_tensor", namespace=torch.ops._c10d_functional)
"""The attention kernels (quadratic in the sequence: the costliest op to redo) and tensor
parallel's reduce-scatter (a collective: recomputing it would repeat the communication)."""


ANNOTATIONS = _ops("_record_function_enter", "_record_function_enter_new",
                   "_record_function_exit", "_record_function_exit._RecordFunction",
                   namespace=torch.ops.profiler)
"""Profiler ranges (`record_function`): not computation, so never saved or replayed. FSDP2
opens one more in a nested unit's recompute than in its forward (the routed experts' unit
under EP takes itself for the forward's root once the step's forward is over), which
selective checkpointing's op count took for a changed region and raised on."""


@functools.cache
def _passing(base: type) -> type:
    """`base` (one of selective checkpointing's dispatch modes) running profiler ranges
    as they come, before its op count sees them."""
    def dispatch(self, func, types, args=(), kwargs=None):
        if func in ANNOTATIONS:
            return func(*args, **(kwargs or {}))
        return base.__torch_dispatch__(self, func, types, args, kwargs)
    return type(f"Passing{base.__name__}", (base,), {"__torch_dispatch__": dispatch})


def _passing_annotations(forward: Any, recompute: Any) -> tuple[Any, Any]:
    """torch's two selective-checkpointing modes, rebuilt as `_passing` ones over the same
    policy and storage (both constructors take (policy_fn, storage, ...) on torch
    2.11-2.15; the recompute mode's policy is unused from 2.13)."""
    caching, cached = _passing(type(forward)), _passing(type(recompute))
    return (caching(forward.policy_fn, forward.storage),
            cached(getattr(recompute, "policy_fn", None), recompute.storage,
                   recompute.allow_cache_entry_mutation))


def op_policy_contexts() -> Any:
    """`--ac op`'s contexts for one checkpointed block call: attention and reduce-scatter
    outputs are saved, and every other matmul's (the 1st, 3rd, ... in the block's order:
    in loom's block, wq, wv, w1 and w2); everything else (norms, rotary, activations, the
    other matmuls) is recomputed in backward. Every other matmul rather than all: each
    recomputed one reads a saved input, and the plan of Llama 3 8B (torchtitan's published
    row) drops from 91.8 GiB (all saved) to 71.9 (every other; published: 82.4) for ~0.3
    of a forward recomputed. The counter is per call and per pass, so the recompute pass
    pairs each matmul with the same decision as the forward."""
    matmuls = {False: 0, True: 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in ALWAYS_SAVED:
            return CheckpointPolicy.MUST_SAVE
        if op in MATMULS:
            matmuls[ctx.is_recompute] += 1
            if matmuls[ctx.is_recompute] % 2 == 1:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return _passing_annotations(*create_selective_checkpoint_contexts(policy))


def apply_ac(plan: ModelPlan, mode: str) -> int:
    """'block': wrap every block; 'selective': wrap every block's attention child; 'op':
    wrap every block with the op policy (`op_policy_contexts`); a model with checkpointing
    of its own (Hugging Face) uses that for any. Returns how many modules were wrapped (or,
    for the model's own, recompute)."""
    if mode == "none":
        return 0
    if mode not in ("block", "selective", "op"):
        raise ValueError(f"unknown activation checkpoint mode {mode!r}")
    if plan.own_ac is not None:
        plan.own_ac()
        logger.info("activation checkpointing: the model's own, %d blocks recomputed",
                    len(plan.blocks()))
        return len(plan.blocks())
    wrapped = 0
    for name, block in list(plan.container.named_children()):
        if mode == "block":
            plan.container.register_module(name, checkpointed(block))
        elif mode == "op":
            plan.container.register_module(name, checkpointed(block, op_policy_contexts))
        elif plan.attention and isinstance(getattr(block, plan.attention, None), nn.Module):
            block.register_module(plan.attention, checkpointed(getattr(block, plan.attention)))
        else:
            continue
        wrapped += 1
    what = "attention modules" if mode == "selective" else "blocks"
    if wrapped == 0:
        logger.warning("activation checkpointing (%s): found no %s to wrap; nothing is "
                       "recomputed", mode, what)
    else:
        logger.info("activation checkpointing (%s): wrapped %d %s", mode, wrapped, what)
    return wrapped
