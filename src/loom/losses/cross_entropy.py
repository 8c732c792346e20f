"""Cross-entropy over logits: eager, row-chunked, chunked-backward and vocab-parallel.

Every function returns the mean over non-ignored tokens, accumulated in fp32 (0, with zero
gradients, where every label is ignored: a depth of multi-token prediction can find no
target in a short answer, and its sum must stay 0, not NaN). The
row-chunk kernels (`softmax_`, `softmax_to_grad_`) are shared with the fused linear loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from loom.data.labels import IGNORE_INDEX


@dataclass(frozen=True)
class VocabShard:
    """The slice of the vocabulary whose logits this rank holds (all of it without a group)."""

    start: int = 0
    group: dist.ProcessGroup | None = None

    @classmethod
    def of(cls, tensor: DTensor, dim: int) -> VocabShard:
        """The shard of a DTensor on a 1-D (tp) mesh, split on its vocabulary dim `dim`."""
        mesh, (placement,) = tensor.device_mesh, tensor.placements
        if not (isinstance(placement, Shard) and placement.dim % tensor.ndim == dim % tensor.ndim):
            return cls()
        size, parts = tensor.shape[dim], mesh.size()
        step = -(-size // parts)  # DTensor splits like torch.chunk: ceil-sized pieces
        return cls(min(mesh.get_local_rank() * step, size), mesh.get_group())


def _local_targets(targets: torch.Tensor, shard: VocabShard, width: int,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of each row's target in this shard (clamped) and whether the shard holds it."""
    local = targets - shard.start
    mine = (local >= 0) & (local < width)
    return local.clamp(0, width - 1), mine


def softmax_(x: torch.Tensor, targets: torch.Tensor, shard: VocabShard,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of fp32 logits x (C, V_local): the log-sum-exp over the whole vocabulary and
    the target logit, with max, sum-exp and target reduced across the shards' group.
    Overwrites x with the softmax."""
    cols, mine = _local_targets(targets, shard, x.shape[1])
    target = torch.where(mine, x.gather(1, cols[:, None]).squeeze(1), 0.0)
    row_max = x.amax(dim=1)
    if shard.group is not None:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=shard.group)
    sum_exp = x.sub_(row_max[:, None]).exp_().sum(dim=1)
    if shard.group is not None:
        both = torch.stack((sum_exp, target))
        dist.all_reduce(both, group=shard.group)
        sum_exp, target = both.unbind()
    x.div_(sum_exp[:, None])
    return row_max + sum_exp.log(), target


def softmax_to_grad_(p: torch.Tensor, targets: torch.Tensor, shard: VocabShard,
                     row_weight: torch.Tensor) -> torch.Tensor:
    """Turn the softmax p (C, V_local) into d loss / d logits = (p - onehot) * row_weight,
    in place; ignored rows carry weight 0. Every row gets its (clamped) target column's
    term, zero where this shard holds no target: a scatter of fixed shape, where selecting
    the rows that hold one (`nonzero`) would read their count back to the host per chunk."""
    cols, mine = _local_targets(targets, shard, p.shape[1])
    p.mul_(row_weight[:, None])
    p.scatter_add_(1, cols[:, None], torch.where(mine, -row_weight, 0.0)[:, None].to(p.dtype))
    return p


def eager_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Plain cross-entropy over full logits (..., V), accumulated in fp32."""
    labels = labels.flatten()
    total = F.cross_entropy(logits.flatten(0, -2).float(), labels, ignore_index=IGNORE_INDEX,
                            reduction="sum")
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)


def chunked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                          chunk_size: int) -> torch.Tensor:
    """Per-row-chunk loss sums over the valid count: the forward's fp32 copy is one chunk at a
    time, while autograd still builds the full gradient."""
    rows, targets = logits.flatten(0, -2), labels.flatten()
    total = sum(F.cross_entropy(x.float(), y, ignore_index=IGNORE_INDEX, reduction="sum")
                for x, y in zip(rows.split(chunk_size), targets.split(chunk_size), strict=True))
    return total / (targets != IGNORE_INDEX).sum().clamp(min=1)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Forward keeps one fp32 chunk and the per-row log-sum-exp; backward recomputes each
    chunk's softmax and writes it into one gradient buffer in the logits' dtype."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk_size: int,
                shard: VocabShard) -> torch.Tensor:
        valid = targets != IGNORE_INDEX
        lse = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, len(targets), chunk_size):
            rows = slice(start, start + chunk_size)
            fp32 = logits[rows].to(torch.float32, copy=True)  # the one chunk-sized copy
            lse[rows], target = softmax_(fp32, targets[rows], shard)
            del fp32
            total += ((lse[rows] - target) * valid[rows]).sum()
        count = valid.sum().clamp(min=1)
        ctx.save_for_backward(logits, targets, lse, count)
        ctx.chunk_size, ctx.shard = chunk_size, shard
        return total / count

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, targets, lse, count = ctx.saved_tensors
        row_weight = (targets != IGNORE_INDEX) * (grad_loss / count)
        grad = torch.empty_like(logits)
        for start in range(0, len(targets), ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            p = logits[rows].to(torch.float32, copy=True).sub_(lse[rows, None]).exp_()
            grad[rows] = softmax_to_grad_(p, targets[rows], ctx.shard, row_weight[rows])
            del p
        return grad, None, None, None


def chunked_backward_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                                   chunk_size: int) -> torch.Tensor:
    """Cross-entropy whose backward recomputes the softmax per row chunk (model-agnostic)."""
    return _ChunkedCrossEntropy.apply(logits.flatten(0, -2), labels.flatten(), chunk_size,
                                      VocabShard())


def vocab_parallel_cross_entropy(logits: DTensor, labels: torch.Tensor,
                                 chunk_size: int) -> torch.Tensor:
    """Cross-entropy of logits that stay sharded on the vocabulary across tp: each rank
    works on its shard, reducing max, sum-exp and the target logit over the tp group."""
    if not isinstance(logits, DTensor) or VocabShard.of(logits, -1).group is None:
        raise ValueError("loss-parallel needs logits sharded on the vocabulary across tp "
                         "(parallelize(..., loss_parallel=True))")
    local = logits.to_local()
    return _ChunkedCrossEntropy.apply(local.flatten(0, -2), labels.flatten(), chunk_size,
                                      VocabShard.of(logits, -1))


def localise(logits: torch.Tensor) -> torch.Tensor:
    """Replicated DTensor logits as a local tensor; vocab-sharded ones are refused, since a
    plain loss over one shard would be silently wrong."""
    if not isinstance(logits, DTensor):
        return logits
    if any(p.is_shard() for p in logits.placements):
        raise ValueError("logits are sharded on the vocabulary; only --loss-impl "
                         "loss-parallel can take them")
    return logits.to_local()
