"""`--loss-impl`: resolve the effective mode once, then build the one criterion.

Fallbacks are decided before the model is built (loss-parallel changes the tp plan) and
written back into the frozen config, so `config.json` records the mode that ran.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
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
from loom.losses.fused_linear import fused_head_loss, fused_linear_cross_entropy
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


def loss_impl_for(cfg: JobConfig) -> str:
    """The effective --loss-impl (a fact for the resolver, `loom.config.resolved.settled`);
    a fallback is logged as one warning line."""
    requested = cfg.loss.loss_impl
    mode, reason = effective_loss_impl(requested, cfg.parallel.tp, cfg.model.runs_transformers)
    if reason is not None:
        logger.warning("--loss-impl %s %s; using %s", requested, reason, mode)
    return mode


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
    head_loss: Callable[[torch.Tensor], Callable[..., torch.Tensor]] | None = None
    """labels -> the loss the head computes on its weight (`head(h, apply=...)`), run inside
    the model's forward (`model_loss`); None: the loss runs on the model's output."""

    def __call__(self, output: torch.Tensor,
                 labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = (labels != IGNORE_INDEX).sum()
        return self.mean(output, labels).float() * count, count

    def model_loss(self, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                   documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum, valid count) of a whole model on `inputs`."""
        if self.head_loss is None:
            return self(self.forward(model, inputs, documents), labels)
        kwargs = {} if documents is None else {"documents": documents}
        count = (labels != IGNORE_INDEX).sum()
        mean = model(inputs, head_apply=self.head_loss(labels), **kwargs)
        return mean.float() * count, count

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
                    in_forward: bool = False) -> Criterion:
    """The criterion of the (already resolved) mode; fused-linear projects through `head`,
    the model's `OutputHead` (None on pipeline stages without it, which never call it).

    `in_forward`: the model takes `head_apply`, so fused-linear's loss is handed to the
    model's forward (`Criterion.model_loss`) rather than applied to the hidden states it
    returns; the caller says where that holds (one stage, no tp or cp)."""
    hidden, head_loss = cfg.loss_impl == "fused-linear", None
    if hidden:
        mean = fused_head_loss(head, cfg.loss_chunk_size)
        head_loss = partial(_with_labels, partial(fused_linear_cross_entropy,
                                                  chunk_size=cfg.loss_chunk_size))
        logger.info("loss: fused-linear, %d-row chunks, %s", cfg.loss_chunk_size,
                    f"vocab-parallel over tp {tp}" if tp > 1 else "full vocabulary")
    else:
        criterion = logits_criterion(cfg.loss_impl, cfg.loss_chunk_size)
        vocab_parallel = cfg.loss_impl == "loss-parallel"
        mean = partial(_logits_mean, criterion, vocab_parallel)
        logger.info("loss: %s", cfg.loss_impl)
    if cfg.debug_logits:
        mean, head_loss = _LogitsProbe(mean, head, hidden), None
    return Criterion(mean, hidden, head_loss if in_forward else None)


def _with_labels(loss: Callable[..., torch.Tensor],
                 labels: torch.Tensor) -> Callable[..., torch.Tensor]:
    return partial(loss, labels=labels)


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
