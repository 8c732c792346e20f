"""Muon's orthogonalization of whole matrices whatever the layout holds of them.

Under FSDP2/HSDP a rank holds a row shard of each matrix, under TP a column or row slice,
under EP whole experts of a 3-D weight, under SimpleFSDP a row shard again, and their
compositions nest these. Newton-Schulz of a shard is not the shard of the matrix's
Newton-Schulz, so each matrix must be orthogonalized whole. Same-shaped matrices with the same
placements are stacked (a 3-D expert weight already is a stack) and redistributed so that
the stack dimension is sharded over every mesh dim the matrices were sharded over: each rank
of the shard group then holds whole matrices, an even share of each shape (the matrices go
to ranks in contiguous runs, so work and traffic spread over the group; ranks of a replicate
dim hold the same share and compute it alike). DTensor's redistribution does the all-to-all,
FSDP's strided shards over TP included; the result goes back the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

Orthogonalize = Callable[[torch.Tensor], torch.Tensor]
"""One whole 2-D matrix in, its orthogonalized update out (torch.optim.Muon's)."""


def _each_matrix(stack: torch.Tensor, fn: Orthogonalize) -> torch.Tensor:
    """`fn` on every matrix of a (n, rows, cols) stack, in the update's dtype."""
    if stack.shape[0] == 0:
        return stack.clone()
    return torch.stack([fn(m).to(stack.dtype) for m in stack])


def _shifted(placement: Placement, by: int) -> Placement:
    """A placement of a matrix as the same placement of a stack of them (dim + `by`)."""
    if isinstance(placement, _StridedShard):
        return _StridedShard(placement.dim + by, split_factor=placement.split_factor)
    if isinstance(placement, Shard):
        return Shard(placement.dim + by)
    return placement


def _whole_matrices(stack: DTensor, fn: Orthogonalize) -> torch.Tensor:
    """The local shard of `fn` on each matrix of a (n, rows, cols) DTensor stack."""
    spread_placements = [p if p.is_replicate() else Shard(0) for p in stack.placements]
    spread = stack.redistribute(stack.device_mesh, spread_placements)
    done = _each_matrix(spread.to_local(), fn)  # whole matrices, this rank's share
    back = DTensor.from_local(done, stack.device_mesh, spread_placements, run_check=False,
                              shape=stack.shape, stride=stack.stride())
    return back.redistribute(stack.device_mesh, stack.placements).to_local()


def _stack(updates: list[DTensor]) -> DTensor:
    """Same-shaped, same-placed matrices as one (n, rows, cols) DTensor, without a copy
    through DTensor's dispatch: the local shards stack as the global matrices do."""
    first = updates[0]
    local = torch.stack([u.to_local() for u in updates])
    placements = [_shifted(p, 1) for p in first.placements]
    shape = torch.Size((len(updates), *first.shape))
    return DTensor.from_local(local, first.device_mesh, placements, run_check=False,
                              shape=shape, stride=torch.empty(shape, device="meta").stride())


def orthogonalize(updates: list[torch.Tensor], fn: Orthogonalize) -> list[torch.Tensor]:
    """Each update (a 2-D matrix, or a 3-D stack of experts' matrices; a DTensor or a plain
    tensor) orthogonalized matrix by matrix, whole: the results are the local shards."""
    out: list[torch.Tensor | None] = [None] * len(updates)
    buckets: dict[tuple, list[int]] = {}
    for i, u in enumerate(updates):
        if not isinstance(u, DTensor):
            out[i] = fn(u).to(u.dtype) if u.ndim == 2 else _each_matrix(u, fn)
        elif u.ndim == 3:
            out[i] = _whole_matrices(u, fn)
        else:
            key = (id(u.device_mesh), tuple(u.placements), tuple(u.shape), u.dtype)
            buckets.setdefault(key, []).append(i)
    for members in buckets.values():
        done = _whole_matrices(_stack([updates[i] for i in members]), fn)
        for j, i in enumerate(members):
            out[i] = done[j]
    return out  # type: ignore[return-value]
