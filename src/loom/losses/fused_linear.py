"""Fused linear cross-entropy: the output projection runs per row chunk inside the loss.

Neither the (tokens x vocab) logits nor their gradient ever exist: each chunk's logits are
projected, turned into the loss and into d loss / d logits, and immediately contracted into
the gradients of the hidden states and of the output weight (the Liger approach), so the
projection is paid once and backward only scales the stored gradients. Under tensor
parallelism each rank projects onto its vocabulary shard of the weight and the softmax
statistics are reduced across tp, bounding rows and vocabulary at once.

The loss runs inside the output head's call (`fused_head_loss`), so FSDP gathers the
weight it uses and reduce-scatters the weight's gradient as for any other forward.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from loom.losses.cross_entropy import IGNORE_INDEX, VocabShard, softmax_, softmax_to_grad_


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, shard: VocabShard,
           row_weight: torch.Tensor, grad_h: torch.Tensor | None,
           grad_w: torch.Tensor | None) -> torch.Tensor:
    """One row chunk: its rows' losses (0 where ignored); writes its rows of grad_h and adds
    into grad_w. Its (C, V_local) temporaries die on return, before the next chunk's are
    made."""
    p = (hidden @ weight.T).float()
    lse, target = softmax_(p, targets, shard)
    row_loss = (lse - target) * (targets != IGNORE_INDEX)
    grad = softmax_to_grad_(p, targets, shard, row_weight).to(hidden.dtype)
    del p
    if grad_h is not None:
        torch.mm(grad, weight, out=grad_h)
    if grad_w is not None and grad_w.dtype == hidden.dtype:
        grad_w.addmm_(grad.T, hidden)
    elif grad_w is not None:  # fp32 master weight, bf16 GEMM: summed over chunks in fp32
        grad_w += grad.T @ hidden
    return row_loss


def compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the chunk GEMMs run in: autocast's where it is on (`torch.mm(out=)` and
    `addmm_` are not autocast operators, so they would run in the fp32 weight's dtype),
    else the hidden states'."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) \
        else hidden.dtype


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Softmax statistics and the loss in fp32, the GEMMs in the compute dtype (autocast's,
    else the inputs'). Where the weight's dtype is the compute dtype, its gradient
    accumulates over chunks in it inside the matmul (as Liger does), since an fp32 buffer
    would add a weight-sized copy and a pass over it per chunk; over an fp32 master weight
    under autocast, each chunk's bf16 product is added into the fp32 gradient, which that
    weight needs anyway."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk_size: int, shard: VocabShard, grad_enabled: bool,
                row_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (N, D), weight (V_local, D), targets (N,) -> (mean loss, or the sum of
        each row's loss times `row_scale` (N,) where given; each row's loss (N,), a value
        only); gradients kept unless grad mode was off at the call (needs_input_grad
        ignores it)."""
        want_h, want_w = (grad_enabled and need for need in ctx.needs_input_grad[:2])
        valid = targets != IGNORE_INDEX
        # a mean where no scale is given (every label ignored: 0, not NaN)
        row_weight = valid / valid.sum().clamp(min=1) if row_scale is None \
            else valid * row_scale
        dtype = compute_dtype(hidden)
        hidden_c, weight_c = hidden.to(dtype), weight.to(dtype)  # no copy where they are
        grad_h = torch.empty_like(hidden_c) if want_h else None  # autograd casts it back
        grad_w = torch.zeros_like(weight) if want_w else None  # the weight's own dtype
        row_loss = torch.empty(len(targets), dtype=torch.float32, device=hidden.device)
        for start in range(0, len(targets), chunk_size):
            rows = slice(start, start + chunk_size)
            row_loss[rows] = _chunk(hidden_c[rows], weight_c, targets[rows], shard,
                                    row_weight[rows],
                                    None if grad_h is None else grad_h[rows], grad_w)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.mark_non_differentiable(row_loss)
        return (row_loss * row_weight).sum(), row_loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, grad_rows: torch.Tensor | None = None):
        grad_h, grad_w = ctx.saved_tensors
        scaled = [None if g is None else g * grad_loss.to(g.dtype) for g in (grad_h, grad_w)]
        return *scaled, None, None, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               chunk_size: int) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against labels, projected chunk by chunk.

    With a vocabulary-sharded DTensor weight (tp), hidden must be a replicated DTensor; each
    rank's hidden-state gradient is then a partial sum over its vocabulary shard.
    """
    return _fused(hidden, weight, labels.flatten(), chunk_size, None,
                  lambda loss, rows: loss)


def fused_linear_sums(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                      row_scale: torch.Tensor, split: int, depths: int,
                      chunk_size: int) -> torch.Tensor:
    """(3,) in one pass over every row of `hidden` (N, D) against `labels` (N,): the sum of
    each valid row's loss times `row_scale` (N,), with gradient (what backward trains),
    then, as values only, the loss sum of rows [:split] and the mean over `depths` of the
    rest's (0 without depths). One call for the main rows and every prediction depth, so
    the weight's gradient is one buffer, as without depths."""
    def sums(loss: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        extra = rows[split:].sum() / depths if depths else rows.new_zeros(())
        return torch.stack([loss, rows[:split].sum(), extra])
    return _fused(hidden, weight, labels, chunk_size, row_scale, sums)


def _fused(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
           row_scale: torch.Tensor | None,
           result: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The fused loss of a plain or vocabulary-sharded (DTensor, tp) weight; `result` forms
    what is returned from (loss, each row's loss), on the local tensors."""
    if not isinstance(weight, DTensor):
        return result(*_FusedLinearCrossEntropy.apply(
            hidden.flatten(0, -2), weight, labels, chunk_size, VocabShard(),
            torch.is_grad_enabled(), row_scale))
    shard = VocabShard.of(weight, 0)
    if not isinstance(hidden, DTensor) or any(not p.is_replicate() for p in hidden.placements):
        raise ValueError("fused-linear under tp needs hidden states replicated across tp")
    local_h = hidden.to_local(grad_placements=[Partial() if shard.group else Replicate()])
    out = result(*_FusedLinearCrossEntropy.apply(
        local_h.flatten(0, -2), weight.to_local(), labels, chunk_size, shard,
        torch.is_grad_enabled(), row_scale))
    return DTensor.from_local(out, weight.device_mesh, [Replicate()], run_check=False)


def fused_head_loss(head: nn.Module, chunk_size: int,
                    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(hidden states, labels) -> mean loss, projected by `head` (an `OutputHead`) inside its
    own call: FSDP unshards the weight and routes its gradient, and the tp plan all-gathers
    the sequence-sharded hidden states and turns the replicated loss into a local tensor."""

    def loss(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return head(hidden, apply=partial(fused_linear_cross_entropy, labels=labels,
                                          chunk_size=chunk_size))

    return loss
