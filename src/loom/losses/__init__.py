"""The six cross-entropy modes of `--loss-impl` and their one dispatcher.

Every mode returns the mean over non-ignored tokens (label -100), accumulated in fp32.
"""

from loom.losses.cross_entropy import (
    IGNORE_INDEX,
    chunked_backward_cross_entropy,
    chunked_cross_entropy,
    eager_cross_entropy,
    vocab_parallel_cross_entropy,
)
from loom.losses.dispatch import (
    MODES,
    Criterion,
    LossFn,
    build_criterion,
    build_loss,
    depth_targets,
    effective_loss_impl,
    logits_criterion,
    loss_impl_for,
)
from loom.losses.fused_linear import fused_linear_cross_entropy

__all__ = [
    "IGNORE_INDEX",
    "MODES",
    "Criterion",
    "LossFn",
    "build_criterion",
    "build_loss",
    "chunked_backward_cross_entropy",
    "chunked_cross_entropy",
    "depth_targets",
    "eager_cross_entropy",
    "effective_loss_impl",
    "fused_linear_cross_entropy",
    "logits_criterion",
    "loss_impl_for",
    "vocab_parallel_cross_entropy",
]
