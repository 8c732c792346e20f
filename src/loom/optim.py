"""AdamW construction and DTensor-aware gradient clipping."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

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


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global L2 norm over all shards (returned, pre-clip); clip when max_norm > 0.

    Gradients on different meshes (e.g. experts later) are normed per mesh and combined,
    since DTensor cannot stack norms across meshes.
    """
    params = [p for p in params if p.grad is not None]
    squares = []
    for grads in _grouped_by_mesh(p.grad for p in params).values():
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    total = torch.stack(squares).sum().sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
