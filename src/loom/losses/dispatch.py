"""`--loss-impl`: resolve the effective mode once, then build the one criterion.

Fallbacks are decided before the model is built (loss-parallel changes the tp plan) and
written back into the frozen config, so `config.json` records the mode that ran.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from loom.config import ConfigError, JobConfig, LossConfig
from loom.losses.cross_entropy import (
    IGNORE_INDEX,
    chunked_backward_cross_entropy,
    chunked_cross_entropy,
    eager_cross_entropy,
    localise,
    vocab_parallel_cross_entropy,
)
from loom.losses.fused_linear import fused_head_loss
from loom.models.registry import output_of

logger = logging.getLogger("loom")

MODES = ("eager", "chunked", "chunked-backward", "compiled", "fused-linear", "loss-parallel")

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
"""(model, inputs (B, T), labels (B, T)) -> mean loss over the non-ignored labels."""



def effective_loss_impl(mode: str, tp: int, hf_model: bool) -> tuple[str, str | None]:
    """The mode that will run and, when it is not the requested one, why."""
    if mode not in MODES:
        raise ConfigError(f"unknown --loss-impl {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "loss-parallel" and tp == 1:
        return "compiled", "needs --tp > 1"
    if mode == "fused-linear" and hf_model:
        return "compiled", "needs loom's own Transformer (its hidden states)"
    return mode, None


def resolve_loss_impl(cfg: JobConfig) -> JobConfig:
    """`cfg` with the effective --loss-impl; a fallback is logged as one warning line."""
    requested = cfg.loss.loss_impl
    mode, reason = effective_loss_impl(requested, cfg.parallel.tp, cfg.model.runs_transformers)
    if reason is not None:
        logger.warning("--loss-impl %s %s; using %s", requested, reason, mode)
    return replace(cfg, loss=replace(cfg.loss, loss_impl=mode))


LogitsLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(logits, labels) -> mean loss over the non-ignored labels."""


def _compiled_cross_entropy() -> LogitsLoss:
    """Eager cross-entropy under torch.compile, so log-softmax, NLL and backward fuse."""
    return torch.compile(eager_cross_entropy)


def logits_criterion(mode: str, chunk_size: int) -> LogitsLoss:
    """The cross-entropy over logits of a mode (every mode but fused-linear)."""
    criteria: dict[str, Callable[[], LogitsLoss]] = {
        "eager": lambda: eager_cross_entropy,
        "chunked": lambda: partial(chunked_cross_entropy, chunk_size=chunk_size),
        "chunked-backward": lambda: partial(chunked_backward_cross_entropy,
                                            chunk_size=chunk_size),
        "compiled": _compiled_cross_entropy,
        "loss-parallel": lambda: partial(vocab_parallel_cross_entropy, chunk_size=chunk_size),
    }
    if mode not in criteria:
        raise ValueError(f"no cross-entropy over logits for loss mode {mode!r}")
    return criteria[mode]()


@dataclass(frozen=True)
class Criterion:
    """(last stage's output, labels) -> (loss sum over the valid tokens, valid-token count).

    Separate from the model's forward, so a pipeline's last stage can apply it to what it
    computed. `hidden`: the output it takes is the final hidden states (the fused head
    projects them), else the logits.
    """

    mean: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    hidden: bool = False

    def __call__(self, output: torch.Tensor,
                 labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = (labels != IGNORE_INDEX).sum()
        return self.mean(output, labels).float() * count, count

    def forward(self, model: nn.Module, inputs: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """What a whole (unpipelined) model gives this criterion; `documents` (--doc-mask)
        only when given, so a model without the argument (transformers') is called as
        before."""
        kwargs = {} if documents is None else {"documents": documents}
        return model(inputs, return_hidden=True, **kwargs) if self.hidden else \
            model(inputs, **kwargs)


class _LogitsProbe:
    """Wraps a criterion's mean to log the first step's logits (finite count, max |logit|).
    Opt-in: with the fused head it runs one more projection and materialises the full
    (tokens x vocab) logits."""

    def __init__(self, mean: LogitsLoss, head: nn.Module | None, hidden: bool):
        self.mean, self.head, self.hidden, self.done = mean, head, hidden, False

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not self.done:
            self.done = True
            with torch.no_grad():
                logits = self.head(output) if self.hidden else output
                logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
            logger.info("logits probe (first step): %d of %d finite, max |logit| %.4g",
                        logits.isfinite().sum().item(), logits.numel(),
                        logits.abs().max().item())
        return self.mean(output, labels)


def build_criterion(cfg: LossConfig, head: nn.Module | None, tp: int = 1,
                    head_compile: dict[str, Any] | None = None) -> Criterion:
    """The criterion of the (already resolved) mode; fused-linear projects through `head`,
    the model's `OutputHead` (None on pipeline stages without it, which never call it).

    `head_compile` (eager and compiled modes only): `torch.compile` arguments under which
    the head's projection and the cross-entropy run as one graph of their own, the model
    handing over its final hidden states; for a model whose forward cannot be one graph
    with its loss (FSDP2's hooks run eagerly between its units). The graph is reached
    through `head(h, apply=...)`, as the fused loss is, so the head's own hooks (FSDP2's
    unshard of its unit) run around it."""
    hidden = cfg.loss_impl == "fused-linear"
    if hidden:
        mean = fused_head_loss(head, cfg.loss_chunk_size)
        logger.info("loss: fused-linear, %d-row chunks, %s", cfg.loss_chunk_size,
                    f"vocab-parallel over tp {tp}" if tp > 1 else "full vocabulary")
    elif head_compile is not None:
        if cfg.loss_impl not in ("eager", "compiled") or head is None:
            raise ValueError(f"no compiled head for loss mode {cfg.loss_impl!r}")
        projected = torch.compile(_projected_cross_entropy, **head_compile)
        mean, hidden = partial(_head_mean, projected, head), True
        logger.info("loss: %s, compiled with the output head as one graph", cfg.loss_impl)
    else:
        criterion = logits_criterion(cfg.loss_impl, cfg.loss_chunk_size)
        vocab_parallel = cfg.loss_impl == "loss-parallel"
        mean = partial(_logits_mean, criterion, vocab_parallel)
        logger.info("loss: %s", cfg.loss_impl)
    if cfg.debug_logits:
        mean = _LogitsProbe(mean, head, hidden)
    return Criterion(mean, hidden)


def _head_mean(projected: Callable[..., torch.Tensor], head: nn.Module, hidden: torch.Tensor,
               labels: torch.Tensor) -> torch.Tensor:
    return head(hidden, apply=partial(projected, labels=labels))


def _projected_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                             labels: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of the head's logits, as a compiled head traces it (the eager and
    compiled modes are then the same graph)."""
    return eager_cross_entropy(F.linear(hidden, weight), labels)


def _logits_mean(criterion: LogitsLoss, vocab_parallel: bool, logits: torch.Tensor,
                 labels: torch.Tensor) -> torch.Tensor:
    return criterion(logits if vocab_parallel else localise(logits), labels)


def build_loss(cfg: LossConfig, model: nn.Module, tp: int = 1) -> LossFn:
    """The mean loss of a whole model: its forward, then the criterion."""
    return partial(_model_loss, build_criterion(cfg, output_of(model), tp))


def _model_loss(criterion: Criterion, model: nn.Module, inputs: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
    loss_sum, count = criterion(criterion.forward(model, inputs), labels)
    return loss_sum / count
