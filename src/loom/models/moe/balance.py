"""The MoE family's step hook: aux-loss-free load balancing of the routed experts.

After each optimizer step every MoE layer's token counts are summed over the ranks that
saw different tokens and each expert's bias moves towards balance. The family's spec
registers this hook (`ModelSpec.hooks`); nothing registers it by being imported.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from loom.models.moe.model import MoE


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


@torch.no_grad()
def update_expert_bias(model: nn.Module, summed: Callable[[torch.Tensor], torch.Tensor],
                       ranks: int, applied: torch.Tensor | None = None
                       ) -> dict[str, torch.Tensor]:
    """After an optimizer step: sum each MoE layer's token counts over the `ranks` ranks
    holding different tokens (dp x cp) with `summed` (the trainer's collective: the model
    itself does no communication), move the expert bias by coeff * sign(mean - count),
    reset the counts and the balance loss's sum; returns the MoE metrics, on the device.

    `applied` (a device scalar, 1.0 or 0.0; None: 1.0) masks the step: after a skipped
    update the bias stays and the counts carry into the next step, as if the hook had not
    run, without the host reading which it was."""
    layers = moe_layers(model)
    if not layers:
        return {}
    counts = torch.stack([m.tokens_per_expert for m in layers])  # (L, E)
    packed = torch.cat([counts.flatten(), torch.stack([m.aux_loss for m in layers])])
    packed = summed(packed)
    counts = packed[:counts.numel()].view_as(counts)
    aux = packed[counts.numel():] / ranks
    keep = 1.0 if applied is None else applied.to(counts.dtype)
    for moe, layer_counts in zip(layers, counts, strict=True):
        if moe.load_balance_coeff > 0:
            moe.expert_bias.add_(keep * moe.load_balance_coeff
                                 * torch.sign(layer_counts.mean() - layer_counts))
        moe.tokens_per_expert.mul_(1.0 - keep)  # zeroed after an applied update
        moe.aux_loss.zero_()  # a metric only: each step's row reports its own
    return moe_metrics(counts, aux if layers[0].aux_loss_coeff > 0 else None)


def moe_metrics(counts: torch.Tensor, aux: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Tokens per expert (min/max/mean over every layer's experts) and load imbalance
    (max/mean per layer, averaged and worst over layers), as device scalars: the metrics
    recorder reads them with the row, at the logging step."""
    imbalance = counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-9)
    values = [counts.min(), counts.max(), counts.mean(), imbalance.mean(), imbalance.max()]
    keys = ["tokens_per_expert_min", "tokens_per_expert_max", "tokens_per_expert_mean",
            "load_imbalance", "load_imbalance_max"]
    if aux is not None:
        values.append(aux.sum())
        keys.append("aux_loss")
    return dict(zip([f"moe/{k}" for k in keys], torch.stack(values).float().unbind(),
                    strict=True))
