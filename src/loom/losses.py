"""Cross-entropy over logits; every mode returns the mean over non-ignored tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def eager_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Plain cross-entropy over full logits (B, T, V), accumulated in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1),
                           ignore_index=IGNORE_INDEX)
