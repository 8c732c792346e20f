"""Every difference between the torch releases loom supports, in one place.

loom supports torch 2.11 (the floor: the GPU machine this project can use runs it) through
2.15 (the newest release). Code elsewhere calls the names here instead of testing versions
itself, so a shim that is no longer needed is deleted from this module alone. Each shim names
the releases that need it and the one it was checked on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

TORCH_FLOOR = "2.11"
TORCH_CEILING = "2.15"


def all_gather_flat(output: torch.Tensor, local: torch.Tensor, group=None) -> None:
    """Every rank's `local`, concatenated along dim 0 into `output` (gloo takes only this
    concatenated form). torch 2.13 renamed `all_gather_into_tensor` to `all_gather_single`
    and deprecates the old name with a warning; 2.11 and 2.12 have only the old name."""
    gather = getattr(dist, "all_gather_single", None)
    if gather is None:  # torch 2.11-2.12 (checked on 2.11.0)
        gather = dist.all_gather_into_tensor
    gather(output, local, group=group)


def all_gather_autograd(x: torch.Tensor, gather_dim: int, group) -> torch.Tensor:
    """Functional all-gather whose backward reduce-scatters the gradient. torch 2.13 renamed
    `all_gather_tensor_autograd` to `all_gather_single_autograd` (the old name warns there);
    2.11 and 2.12 have only the old name (checked on 2.11.0)."""
    gather = getattr(funcol, "all_gather_single_autograd", None)
    if gather is None:
        gather = funcol.all_gather_tensor_autograd
    return gather(x, gather_dim, group)


# torch.optim.Muon's own pieces, private in every supported release with these signatures
# (checked on 2.11.0, 2.13.0, 2.15.0): loom applies torch's update to each whole matrix.
from torch.optim._muon import _adjust_lr as muon_adjust_lr  # noqa: E402
from torch.optim._muon import _zeropower_via_newtonschulz as newton_schulz  # noqa: E402

__all__ = ["TORCH_CEILING", "TORCH_FLOOR", "all_gather_autograd", "all_gather_flat",
           "muon_adjust_lr", "newton_schulz"]
