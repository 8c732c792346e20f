"""AdamW construction, learning-rate schedules and DTensor-aware gradient clipping."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from loom.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW with the fused kernel where the parameters' device supports it, else foreach."""
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = dict(lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(params, foreach=True, **kwargs)


def _grouped_by_mesh(grads: Iterable[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        groups[g.device_mesh if isinstance(g, DTensor) else None].append(g)
    return groups


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float,
                   across: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Global L2 norm over all shards (returned, pre-clip); clip when max_norm > 0.

    Gradients on different meshes (e.g. experts later) are normed per mesh and combined,
    since DTensor cannot stack norms across meshes; `across` (the pipeline's ranks) holds
    the other parameters, whose squares are summed in.
    """
    groups = _grouped_by_mesh(p for p in params if p.grad is not None).values()
    squares = []
    for group in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    total = torch.stack(squares).sum()
    if across is not None:
        dist.all_reduce(total, group=across)
    total = total.sqrt()
    if max_norm > 0:
        for group in groups:  # one foreach per mesh: DTensor cannot mix meshes in one op
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
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
