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


def torch_minor() -> tuple[int, int]:
    """The running torch's (major, minor) release, e.g. (2, 13) for 2.13.0+cpu."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def checkpoint_inside_compile_saves_mesh() -> bool:
    """Whether AOT autograd fails a compiled region that holds a checkpointed DTensor
    redistribution (tensor parallel's sequence-parallel transitions, SimpleFSDP's gathers):
    torch 2.13 registers DeviceMesh as an opaque reference type, and the partitioner puts the
    mesh the recompute needs among the saved tensors, so the first backward raises `expected
    all tensors_saved_with_vc_check to be Tensors` (torchtitan 0.2.2's own apply_tp +
    apply_ac + apply_compile fails the same way). Checked on 2.13.0 (fails), 2.11.0
    (DeviceMesh is not opaque there) and 2.15.0 (fixed); 2.12 and 2.14 are unchecked and
    counted as failing, which only costs them the order `loom.parallel.parallelize` falls
    back to (checkpoint around the compiled block). tests/parity/test_upstream_compiled_
    ac.py reproduces it on each version."""
    return (2, 12) <= torch_minor() < (2, 15)


def torch_release() -> str:
    """The running torch's release without the build tag: '2.13.0' for 2.13.0+cpu."""
    return torch.__version__.split("+")[0]


def v_schedules_send_to_own_rank() -> bool:
    """Whether torch's V-shaped pipeline schedules (ZBVZeroBubble, DualPipeV) send the
    activation between a rank's two adjacent stages (the V's turn) to the rank itself,
    which gloo cannot: the first step's stage initialisation fails with `Pair is not
    connected`. torch 2.13 hands it over in-process (its "V-schedule special case"); checked
    failing on 2.11.0, running on 2.13.0 and 2.15.0; 2.12 is unchecked and counted failing.
    tests/parity/test_upstream_zbv.py reproduces it with torch alone."""
    return torch_minor() < (2, 13)


# torch.optim.Muon's own pieces, private in every supported release with these signatures
# (checked on 2.11.0, 2.13.0, 2.15.0): loom applies torch's update to each whole matrix.
from torch.optim._muon import _adjust_lr as muon_adjust_lr  # noqa: E402
from torch.optim._muon import _zeropower_via_newtonschulz as newton_schulz  # noqa: E402

__all__ = [
    "TORCH_CEILING",
    "TORCH_FLOOR",
    "all_gather_autograd",
    "all_gather_flat",
    "checkpoint_inside_compile_saves_mesh",
    "muon_adjust_lr",
    "newton_schulz",
    "torch_minor",
    "torch_release",
    "v_schedules_send_to_own_rank",
]
