"""Optimizer construction (AdamW, or Muon with AdamW), learning-rate schedules and
gradient clipping over sharded gradients."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from loom.checkpoint.checkpointer import plain_namer
from loom.config import OptimConfig
from loom.config.optim import ns_coefficients
from loom.trainer.muon import MuonWithAdamW

NOT_MUON = frozenset({"router", "gate"})
"""Module names of MoE routers (loom's `moe.router`, Hugging Face's `mlp.gate`): a router's
matrix scores experts, it is no hidden projection, and it takes AdamW."""


def takes_muon(name: str, param: torch.Tensor) -> bool:
    """The family-neutral rule of Muon's groups: a matrix (or a 3-D stack of experts'
    matrices) inside the blocks (`layers.`: every family, loom's and Hugging Face's, keeps
    its blocks there, and the checkpoint and export key on those names), other than a
    router's. Embeddings, the output head, norms, biases and routers take AdamW. By name and
    shape, not by the plan's modules: the name is what every layout, stage and wrapper
    keeps (`plain_namer` strips SimpleFSDP's and the pipeline's additions)."""
    parts = name.split(".")
    return param.ndim in (2, 3) and "layers" in parts and not NOT_MUON & set(parts)


def _adamw(params: list[torch.Tensor], lr: float) -> torch.optim.AdamW:
    """AdamW with the fused kernel where the parameters' device supports it, else foreach."""
    kwargs = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(params, foreach=True, **kwargs)


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over every trainable parameter, or Muon over the blocks' matrices
    (`takes_muon`) and AdamW over the rest, as one optimizer."""
    named = [(plain_namer(model)(n), p) for n, p in model.named_parameters() if p.requires_grad]
    if cfg.optimizer == "adamw":
        return _adamw([p for _, p in named], cfg.lr)
    muon = [p for n, p in named if takes_muon(n, p)]
    rest = [p for n, p in named if not takes_muon(n, p)]
    adamw = _adamw(rest, cfg.lr) if rest else None  # LoRA: every trainable one is a matrix
    return MuonWithAdamW(
        muon, adamw, lr=cfg.lr if cfg.muon_lr is None else cfg.muon_lr,
        ns_dtype=cfg.muon_ns_dtype,
        weight_decay=cfg.muon_weight_decay, momentum=cfg.muon_momentum,
        nesterov=cfg.muon_nesterov, ns_coefficients=ns_coefficients(cfg.muon_ns_coefficients),
        ns_steps=cfg.muon_ns_steps, adjust_lr_fn=cfg.muon_adjust_lr.replace("-", "_"))


ShardKey = tuple[object, tuple[int, ...]]
"""(device mesh or None, the mesh dims a gradient is sharded over)."""


def _local_by_sharding(grads: Iterable[torch.Tensor]) -> dict[ShardKey, list[torch.Tensor]]:
    """Local shards grouped by the mesh dims their squares must be summed over (every
    sharding, FSDP's strided one on top of tp too; Replicate dims hold copies). The data-
    parallel wrappers leave no gradient Partial: one would be a bug, not a case to norm."""
    groups: dict[ShardKey, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        if not isinstance(g, DTensor):
            groups[None, ()].append(g)
            continue
        if any(p.is_partial() for p in g.placements):
            raise RuntimeError(f"gradient with placements {g.placements} was never reduced")
        dims = tuple(i for i, p in enumerate(g.placements) if not p.is_replicate())
        # DTensor's private `_local_tensor` (torch 2.13): the same shard as `to_local()`
        # without its autograd node, which a gradient needs not: one host operator less each
        groups[g.device_mesh if dims else None, dims].append(g._local_tensor)
    return groups


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float,
                   across: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Global L2 norm over all shards (returned, pre-clip); clip when max_norm > 0.

    Computed on the local shards: one foreach norm per sharding, its squares summed over the
    mesh dims it is sharded on, and one foreach multiply; DTensor's dispatch of the same
    ops cost ~5% of a small model's step on the CPU. `across` (the pipeline's ranks) holds
    the other parameters, whose squares are summed in.
    """
    groups = _local_by_sharding(p.grad for p in params if p.grad is not None)
    squares = []
    for (mesh, dims), local in groups.items():
        square = torch.stack(torch._foreach_norm(local, 2, dtype=torch.float32)).square().sum()
        for dim in dims:
            if mesh.size(dim) > 1:
                dist.all_reduce(square, group=mesh.get_group(dim))
        squares.append(square)
    total = torch.stack(squares).sum()
    if across is not None:
        dist.all_reduce(total, group=across)
    total = total.sqrt()
    if max_norm > 0:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([g for local in groups.values() for g in local], coef)
    return total


def lr_multiplier(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Fraction of --lr at 0-based `step`: linear warmup, then the schedule's decay to
    min_lr_ratio at the last step (wsd holds the peak until its final decay_fraction)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    floor = cfg.min_lr_ratio
    if cfg.lr_schedule == "wsd":
        decay_steps = max(1, round(cfg.decay_fraction * total_steps))
        start = max(cfg.warmup_steps, total_steps - decay_steps)
    else:
        start = cfg.warmup_steps
    progress = min(1.0, max(0.0, (step - start) / max(1, total_steps - 1 - start)))
    if cfg.lr_schedule == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return floor + (1 - floor) * (1 - progress)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig,
                       total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, cfg))
