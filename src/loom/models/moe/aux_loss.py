"""DeepSeek-V3's sequence-wise balance loss, formed from per-sequence sums, and how a
model adds a loss of its own to the step's backward (`add_loss`).

The loss is a function of sums over each sequence's tokens (picks per expert, normalised
router scores per expert, the token count). Under context parallel every rank holds part
of each sequence, so the MoE layer hands its partial sums to a `SequenceSum` (set from
outside: models do no communication) that adds them up over the ranks sharing the
sequences, with gradient, before the loss is formed; on one process it is the identity.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

SequenceSum = Callable[[torch.Tensor], torch.Tensor]
"""(B, 2E + 1) this rank's per-sequence sums -> the whole sequences' sums (same shape)."""


def sequence_sums(scores: torch.Tensor, expert_idx: torch.Tensor,
                  bsz: int) -> torch.Tensor:
    """Per sequence (B, 2E + 1): the picks of each expert, the normalised scores summed per
    expert and the token count, over the tokens given (all of them, or a cp shard)."""
    n_experts = scores.shape[-1]
    probs = (scores / scores.sum(dim=-1, keepdim=True)).view(bsz, -1, n_experts)  # (B, T, E)
    picks = F.one_hot(expert_idx.view(bsz, -1), n_experts).sum(dim=1).to(probs.dtype)
    tokens = probs.new_full((bsz, 1), probs.shape[1])
    return torch.cat([picks, probs.sum(dim=1), tokens], dim=-1)


def balance_loss_from_sums(sums: torch.Tensor, top_k: int) -> torch.Tensor:
    """sum_i f_i * P_i averaged over sequences: f_i = E/(k*T) * picks of expert i, P_i = the
    mean over the sequence of its normalised scores, from `sequence_sums`' columns."""
    n_experts = (sums.shape[-1] - 1) // 2
    picks, prob_sums, tokens = sums.split([n_experts, n_experts, 1], dim=-1)
    f = picks * n_experts / (top_k * tokens)
    return (f * prob_sums / tokens).sum(dim=-1).mean()


def sequence_balance_loss(scores: torch.Tensor, expert_idx: torch.Tensor, bsz: int,
                          sequence_sum: SequenceSum | None = None) -> torch.Tensor:
    """The balance loss of `bsz` sequences whose tokens' scores (N, E) and picks (N, k) are
    given; `sequence_sum` completes partial sequences (context parallel) first."""
    sums = sequence_sums(scores, expert_idx, bsz)
    if sequence_sum is not None:
        sums = sequence_sum(sums)
    return balance_loss_from_sums(sums, expert_idx.shape[-1])


class _AddLoss(torch.autograd.Function):
    """Identity on x whose backward also sends gradient 1 into `loss`, so a loss the model
    adds trains without changing what the model returns. Its backward adds the loss's value
    to `total` (None: nothing), once per trained forward, as the MoE's pick counts are: the
    metric sums each micro-batch's share, also when activation checkpointing recomputes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor,
                total: torch.Tensor | None) -> torch.Tensor:
        ctx.loss_dtype, ctx.value, ctx.total = loss.dtype, loss.detach(), total
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        if ctx.total is not None:
            ctx.total.add_(ctx.value)
        return grad, torch.ones((), dtype=ctx.loss_dtype, device=grad.device), None


def add_loss(x: torch.Tensor, loss: torch.Tensor,
             total: torch.Tensor | None = None) -> torch.Tensor:
    """x, whose backward also trains `loss` (a scalar, gradient 1) and adds its value to
    `total` (a metric buffer) once per trained forward."""
    return _AddLoss.apply(x, loss, total)
