"""Gradient accumulation's one switch, whichever data-parallel strategy wrapped the model."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule

from loom.parallel.simple_fsdp import set_gather_sync


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """Reduce gradients in the next backward, or keep them local until a synced one: FSDP2's
    units, or SimpleFSDP's gathers."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
    else:
        set_gather_sync(model, sync)
