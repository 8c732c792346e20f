"""The MoE family's step hooks: aux-loss-free load balancing of the routed experts, and
the sequence-wise balance loss's metric.

After each optimizer step every MoE layer's token counts are summed over the ranks that
saw different tokens and each expert's bias moves towards balance. The family's spec
registers these hooks (`ModelSpec.hooks`); nothing registers them by being imported.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from loom.models.moe.model import MoE, MoETransformer


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


@torch.no_grad()
def update_expert_bias(model: nn.Module, summed: Callable[[torch.Tensor], torch.Tensor],
                       ranks: int, applied: torch.Tensor | None = None
                       ) -> dict[str, torch.Tensor]:
    """After an optimizer step: sum each MoE layer's token counts over the `ranks` ranks
    holding different tokens (dp x cp) with `summed` (the trainer's collective: the model
    itself does no communication), move the expert bias by coeff * sign(mean - count),
    reset the counts; returns the MoE metrics, on the device.

    `applied` (a device scalar, 1.0 or 0.0; None: 1.0) masks the step: after a skipped
    update the bias stays and the counts carry into the next step, as if the hook had not
    run, without the host reading which it was."""
    layers = moe_layers(model)
    if not layers:
        return {}
    counts = summed(torch.stack([m.tokens_per_expert for m in layers]))  # (L, E)
    keep = 1.0 if applied is None else applied.to(counts.dtype)
    for moe, layer_counts in zip(layers, counts, strict=True):
        if moe.load_balance_coeff > 0:
            moe.expert_bias.add_(keep * moe.load_balance_coeff
                                 * torch.sign(layer_counts.mean() - layer_counts))
        moe.tokens_per_expert.mul_(1.0 - keep)  # zeroed after an applied update
    return moe_metrics(counts)


@torch.no_grad()
def balance_loss_metric(model: nn.Module, summed: Callable[[torch.Tensor], torch.Tensor],
                        ranks: int, applied: torch.Tensor | None = None
                        ) -> dict[str, torch.Tensor]:
    """`moe/aux_loss`: the step's sequence-wise balance loss (each forward's share, as
    `MoE.aux_loss` sums them), over every MoE layer, averaged over the `ranks` ranks holding
    different tokens; a metric only, so `applied` changes nothing. Its hook sums over the
    pipeline stages too (`SpecHook.stages`), so every rank of a run with the loss reports
    it, a stage without MoE layers adding zero."""
    owners = [m for m in model.modules() if isinstance(m, MoETransformer)]
    if not any(owner.args.aux_loss_coeff > 0 for owner in owners):
        return {}
    held = torch.zeros((), device=next(model.parameters()).device)
    for moe in moe_layers(model):
        held += moe.aux_loss
        moe.aux_loss.zero_()  # each step's row reports its own
    return {"moe/aux_loss": summed(held) / ranks}


def moe_metrics(counts: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tokens per expert (min/max/mean over every layer's experts) and load imbalance
    (max/mean per layer, averaged and worst over layers), as device scalars: the metrics
    recorder reads them with the row, at the logging step."""
    imbalance = counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-9)
    values = [counts.min(), counts.max(), counts.mean(), imbalance.mean(), imbalance.max()]
    keys = ["tokens_per_expert_min", "tokens_per_expert_max", "tokens_per_expert_mean",
            "load_imbalance", "load_imbalance_max"]
    return dict(zip([f"moe/{k}" for k in keys], torch.stack(values).float().unbind(),
                    strict=True))
