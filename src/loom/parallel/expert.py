"""Expert parallel (EP) and expert tensor parallel (ETP): placements and the token dispatch.

The MoE family's plan (models/moe/plan.py) applies them to its blocks; this module
names no module of any family.

EP shards the routed experts on dim 0 over the `ep` dim of the expert mesh (`ParallelDims`:
at etp 1 it spans dp_shard x cp x tp ranks, tp first; at etp = tp it spans dp_shard x cp).
Before the experts run, every token slot travels to the rank that owns its expert (an
all-to-all with uneven splits) and is regrouped by local expert; afterwards it travels
back (combine). At etp 1 the tp ranks split the token slots, each dispatching its share,
so whole experts sit on tp ranks as on any other; ETP (etp = tp) instead splits each
expert's hidden dim across tp, every tp rank running all the slots. Either way a MoE
block's routed and shared outputs are partial sums over tp, reduced back to
sequence-sharded once, like a dense feed-forward's. Without EP (ep 1) at etp 1 the experts
are replicated over tp and their gradients, partial per tp rank, are summed.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
)

from loom.parallel.mesh import ParallelDims

logger = logging.getLogger("loom")

WEIGHTS = ("w1", "w2", "w3")


def sum_grad_over(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity in forward; in backward the per-rank gradients, each a partial sum, are
    summed over `mesh`."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(
        grad_placements=[Partial()])


def expert_order(per_rank: torch.Tensor, total: int) -> torch.Tensor:
    """Rows received as (source rank, local expert) segments, per_rank[i, e] rows each:
    the indices that reorder them to (local expert, source rank)."""
    lens = per_rank.flatten()
    starts = (lens.cumsum(0) - lens).view_as(per_rank).T.flatten()
    new_lens = per_rank.T.flatten()
    new_starts = new_lens.cumsum(0) - new_lens
    shift = torch.repeat_interleave(starts - new_starts, new_lens, output_size=total)
    return torch.arange(total, device=per_rank.device) + shift


def even_splits(rows: int, parts: int) -> list[int]:
    """`rows` split as evenly as whole rows allow, the larger parts first."""
    return [rows // parts + (i < rows % parts) for i in range(parts)]


def window_counts(counts: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows per expert inside rows [lo, hi) of rows grouped by expert (counts[e] each)."""
    ends = counts.cumsum(0)
    return (ends.clamp(max=hi) - (ends - counts).clamp(min=lo)).clamp(min=0)


class TokenDispatcher:
    """Forward hooks around one `GroupedExperts`: tp step, then EP dispatch, on the way in;
    EP combine, then tp step, on the way out. Holds the splits between the two."""

    def __init__(self, ep_group: dist.ProcessGroup | None, tp_mesh: DeviceMesh | None,
                 split_tokens: bool):
        self.ep_group, self.tp_mesh, self.split_tokens = ep_group, tp_mesh, split_tokens
        self._state: tuple = ()

    def before(self, module: nn.Module, args: tuple[torch.Tensor, torch.Tensor]) -> tuple:
        x, counts = args  # (M, dim) grouped by expert, (E,)
        pad = None
        if self.tp_mesh is not None and self.split_tokens:
            x, counts, pad = self._take_tp_slice(x, counts)
        elif self.tp_mesh is not None:
            x = sum_grad_over(x, self.tp_mesh)
        route = None
        if self.ep_group is not None:
            x, counts, route = self._dispatch(x, counts)
        self._state = (pad, route)
        return x, counts

    def after(self, module: nn.Module, args: tuple, y: torch.Tensor) -> torch.Tensor:
        pad, route = self._state
        if route is not None:
            order, input_splits, output_splits = route
            y = all_to_all_single_autograd(y[order.argsort()], input_splits, output_splits,
                                           self.ep_group)
        if pad is not None:
            y = F.pad(y, (0, 0, *pad))  # zeros for the other ranks' slots: a partial sum
        return y

    def _take_tp_slice(self, x: torch.Tensor, counts: torch.Tensor) -> tuple:
        """This tp rank's contiguous share of the slots (and the rows before and after it);
        backward all-gathers the gradient."""
        rank, size = self.tp_mesh.get_local_rank(), self.tp_mesh.size()
        rows = x.shape[0] // size
        local = DTensor.from_local(x, self.tp_mesh, [Replicate()], run_check=False)
        local = local.redistribute(self.tp_mesh, [Shard(0)]).to_local()
        lo, hi = rank * rows, (rank + 1) * rows
        return local, window_counts(counts, lo, hi), (lo, x.shape[0] - hi)

    def _dispatch(self, x: torch.Tensor, counts: torch.Tensor) -> tuple:
        """Exchange per-expert counts, derive the splits, move the rows, regroup them.
        Fake tensors (`loom plan`'s trace) carry no counts: the routing is taken as
        balanced, every rank sending an equal share of its rows to each."""
        ep = dist.get_world_size(self.ep_group)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.ep_group)
        per_rank = received.view(ep, -1)  # [source rank, local expert]
        if not torch.compiler.is_compiling() and is_fake(counts):
            input_splits = output_splits = even_splits(x.shape[0], ep)
        else:
            input_splits = counts.view(ep, -1).sum(dim=1).tolist()
            output_splits = per_rank.sum(dim=1).tolist()
        x = all_to_all_single_autograd(x, output_splits, input_splits, self.ep_group)
        order = expert_order(per_rank, sum(output_splits))
        return x[order], per_rank.sum(dim=0), (order, input_splits, output_splits)


def expert_placements(dims: ParallelDims) -> tuple[tuple[str, ...], dict[str, list[Placement]]]:
    """Mesh dims the routed experts live on and each weight's placements on them: 'ep'
    (and 'etp') of the expert mesh under EP, else the dense 'tp' (sharded at etp = tp,
    replicated at etp 1)."""
    names: list[str] = []
    placements: dict[str, list[Placement]] = {w: [] for w in WEIGHTS}
    hidden = {"w1": Shard(1), "w2": Shard(2), "w3": Shard(1)}
    if dims.ep_enabled:
        names.append("ep")
        for w in WEIGHTS:
            placements[w].append(Shard(0))
        if dims.etp_enabled:
            names.append("etp")
            for w in WEIGHTS:
                placements[w].append(hidden[w])
    elif dims.tp_enabled:
        names.append("tp")
        for w in WEIGHTS:
            placements[w].append(hidden[w] if dims.etp_enabled else Replicate())
    return tuple(names), placements
