"""FSDP2's all-gather and reduce-scatter over gloo, built from point-to-point exchanges.

On gloo (torch 2.13, 2 ranks, 80 MB, AVX2 EPYC) ``all_gather_into_tensor`` takes ~145 ms and
``reduce_scatter_tensor`` ~175 ms, while sending the same bytes between the ranks takes
~40 ms: these collectives, not the matmuls, were most of a 2-rank CPU step's overhead.
Both are rewritten here as exchanges of one shard with each peer, with no extra buffer.
NCCL and the other accelerator backends keep FSDP's own collectives.

Torch's Flight Recorder does not see point-to-point sends on gloo, so each exchange records
itself in `loom.runtime.flight` as it is posted. Every FSDP unit gets its own pair of collectives,
which know the unit's name: a hang report then says whose parameters a stuck exchange
moves, whatever order prefetching, activation checkpointing or compile run them in.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin

from loom.runtime import flight


def _slot(flat: torch.Tensor, index: int, size: int) -> torch.Tensor:
    """Part `index` of `size` equal parts of a collective's buffer: one `narrow` of FSDP's
    flat buffers (a view and an index would be two host operators, per unit per step)."""
    if flat.dim() == 1:
        step = flat.numel() // size
        return flat.narrow(0, index * step, step)
    return flat.view(size, -1)[index]


class _AllOf(dist.Work):
    """One handle for several point-to-point requests: FSDP waits on it like on a collective."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: object = None) -> bool:
        with flight.blocked():  # a straggler's peers wait here: see loom.runtime.straggler
            for work in self._works:
                work.wait()
        return True


def _exchange(group: dist.ProcessGroup, sends: list[tuple[torch.Tensor, int]],
              receives: list[tuple[torch.Tensor, int]]) -> _AllOf:
    """Post every send and receive at once; peers are ranks within `group`."""
    ops = [dist.P2POp(op, tensor, dist.get_global_rank(group, peer), group)
           for op, pairs in ((dist.isend, sends), (dist.irecv, receives))
           for tensor, peer in pairs]
    return _AllOf(dist.batch_isend_irecv(ops))


class PairwiseAllGather(DefaultAllocMixin, AllGather):
    """Send this rank's shard to every peer and receive theirs into their slots of the output
    (FSDP has already copied this rank's shard into its own slot). `unit` names the FSDP
    unit whose parameters it gathers, for hang reports."""

    def __init__(self, unit: str | None = None) -> None:
        super().__init__()
        self.unit = unit

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        flight.entered("all_gather", group.group_desc, group.group_name, self.unit)
        rank, size = group.rank(), group.size()
        peers = [peer for peer in range(size) if peer != rank]
        work = _exchange(group, [(input_tensor, peer) for peer in peers],
                         [(_slot(output_tensor, peer, size), peer) for peer in peers])
        if async_op:
            return work
        work.wait()
        return None


class PairwiseReduceScatter(DefaultAllocMixin, ReduceScatter):
    """Round k sends the chunk owned by rank r+k and adds the one received from rank r-k.
    The first round receives straight into the output, later ones into the input chunk the
    previous round sent, so no buffer is allocated; FSDP never reads the input again. `unit`
    names the FSDP unit whose gradients it reduces, for hang reports."""

    def __init__(self, unit: str | None = None) -> None:
        super().__init__()
        self.unit = unit

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: object = dist.ReduceOp.SUM,
                 async_op: bool = False) -> dist.Work | None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):  # gloo's own, in the recorder
            with flight.moving(self.unit) if self.unit else contextlib.nullcontext():
                return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op,
                                                  group=group, async_op=async_op)
        flight.entered("reduce_scatter", group.group_desc, group.group_name, self.unit)
        rank, size = group.rank(), group.size()

        def chunk(i: int) -> torch.Tensor:
            return _slot(input_tensor, i, size)

        if size == 1:
            output_tensor.copy_(chunk(0))
        for k in range(1, size):
            into = output_tensor if k == 1 else chunk((rank + k - 1) % size)
            _exchange(group, [(chunk((rank + k) % size), (rank + k) % size)],
                      [(into, (rank - k) % size)]).wait()
            output_tensor += chunk(rank) if k == 1 else into
        if op == dist.ReduceOp.AVG:
            output_tensor /= size
        return None


def use_pairwise_collectives(units: list[tuple[str, FSDPModule]]) -> None:
    """Give every FSDP2 unit (with its name) the point-to-point collectives (gloo only)."""
    for name, unit in units:
        unit.set_custom_all_gather(PairwiseAllGather(name))
        unit.set_custom_reduce_scatter(PairwiseReduceScatter(name))
