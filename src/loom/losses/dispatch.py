"""`--loss-impl`: resolve the effective mode once, then build the one loss function.

Fallbacks are decided before the model is built (loss-parallel changes the tp plan) and
written back into the frozen config, so `config.json` records the mode that ran.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from loom.config import ConfigError, JobConfig, LossConfig
from loom.losses.cross_entropy import (
    chunked_backward_cross_entropy,
    chunked_cross_entropy,
    eager_cross_entropy,
    localise,
    vocab_parallel_cross_entropy,
)
from loom.losses.fused_linear import apply_fused_head, fused_linear_loss
from loom.presets import is_hf_model

logger = logging.getLogger("loom")

MODES = ("eager", "chunked", "chunked-backward", "compiled", "fused-linear", "loss-parallel")

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
"""(model, inputs (B, T), labels (B, T)) -> mean loss over the non-ignored labels."""

Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
    requested, name = cfg.loss.loss_impl, cfg.model.model
    mode, reason = effective_loss_impl(requested, cfg.parallel.tp,
                                       name is not None and is_hf_model(name))
    if reason is not None:
        logger.warning("--loss-impl %s %s; using %s", requested, reason, mode)
    return replace(cfg, loss=replace(cfg.loss, loss_impl=mode))


def _compiled_cross_entropy() -> Criterion:
    """Eager cross-entropy under torch.compile, so log-softmax, NLL and backward fuse."""
    return torch.compile(eager_cross_entropy)


def logits_criterion(mode: str, chunk_size: int) -> Criterion:
    """The cross-entropy over logits of a mode (every mode but fused-linear)."""
    criteria: dict[str, Callable[[], Criterion]] = {
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


def _logits_loss(criterion: Criterion, vocab_parallel: bool, model: nn.Module,
                 inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return criterion(logits if vocab_parallel else localise(logits), labels)


class _LogitsProbe:
    """Wraps a LossFn to log the first step's logits (finite count, max |logit|). Opt-in:
    it runs one more forward and materialises the full (tokens x vocab) logits."""

    def __init__(self, loss_fn: LossFn):
        self.loss_fn, self.done = loss_fn, False

    def __call__(self, model: nn.Module, inputs: torch.Tensor,
                 labels: torch.Tensor) -> torch.Tensor:
        if not self.done:
            self.done = True
            with torch.no_grad():
                logits = model(inputs)
                logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
            logger.info("logits probe (first step): %d of %d finite, max |logit| %.4g",
                        logits.isfinite().sum().item(), logits.numel(),
                        logits.abs().max().item())
        return self.loss_fn(model, inputs, labels)


def build_loss(cfg: LossConfig, model: nn.Module, tp: int = 1) -> LossFn:
    """The loss function of the (already resolved) mode; fused-linear also installs the
    fused head on `model.output`."""
    loss_fn = _build_loss(cfg.loss_impl, cfg.loss_chunk_size, model, tp)
    return _LogitsProbe(loss_fn) if cfg.debug_logits else loss_fn


def _build_loss(mode: str, chunk: int, model: nn.Module, tp: int) -> LossFn:
    if mode == "fused-linear":
        apply_fused_head(model.output, chunk)
        logger.info("loss: fused-linear, %d-row chunks, %s", chunk,
                    f"vocab-parallel over tp {tp}" if tp > 1 else "full vocabulary")
        return fused_linear_loss
    criterion = logits_criterion(mode, chunk)
    logger.info("loss: %s", mode)
    return partial(_logits_loss, criterion, mode == "loss-parallel")
