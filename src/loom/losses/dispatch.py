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
from loom.losses.fused_linear import fused_head_loss, fused_linear_sums
from loom.models.context import ForwardContext, HeadApply, context_of
from loom.models.registry import output_of
from loom.models.spec import NO_DEPTHS, Depths

logger = logging.getLogger("loom")

MODES = ("eager", "chunked", "chunked-backward", "compiled", "fused-linear", "loss-parallel")

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
"""(model, inputs (B, T), labels (B, T)) -> mean loss over the non-ignored labels."""
LogitsLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(logits, labels) -> mean loss over the non-ignored labels."""



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


def _sum(mean: LogitsLoss, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return mean(output, labels).float() * (labels != IGNORE_INDEX).sum()


def scored_sums(mean: LogitsLoss, output: torch.Tensor, targets: torch.Tensor,
                weight: float = 0.0) -> torch.Tensor:
    """(3,) fp32: the objective backward trains (the main rows' loss sum over their valid
    labels, plus `weight` times the mean over the extra depths of each depth's loss sum),
    then, as values only, the main sum and the depths' mean (0 without depths). `targets`
    (B, T): the main rows' labels; (B, 1 + D, T): each depth's too (`depth_targets`), with
    `output` holding (1 + D) * B rows, depth-major. All depths are scored in one call of
    `mean`, so a chunked loss chunks them as it chunks the main rows."""
    if targets.dim() < 3:  # the main rows alone (a flat (N,) batch of labels too)
        main = _sum(mean, output, targets)
        return torch.stack([main, main.detach(), torch.zeros_like(main)])
    batch, depths = targets.shape[0], targets.shape[1] - 1
    main = _sum(mean, output[:batch], targets[:, 0])
    extra = _sum(mean, output[batch:], targets[:, 1:].transpose(0, 1).flatten(0, 1)) / depths
    return torch.stack([main + weight * extra, main.detach(), extra.detach()])


def fused_sums(chunk_size: int, weight: float, targets: torch.Tensor) -> HeadApply:
    """(hidden states, the head's weight) -> `scored_sums`' (3,) for fused-linear, every
    row (main and depths) in one fused pass: the depths' rows weighted `weight` / D, so
    the head's weight gradient is one buffer with or without depths."""
    if targets.dim() < 3:  # the main rows alone (a flat (N,) batch of labels too)
        labels, depths = targets.flatten(), 0
    else:
        depths = targets.shape[1] - 1
        labels = torch.cat([targets[:, 0].flatten(),
                            targets[:, 1:].transpose(0, 1).flatten()])
    split = targets.shape[0] * targets.shape[-1]
    scale = torch.ones(labels.shape, device=labels.device)
    scale[split:] = weight / max(depths, 1)

    def apply(hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        return fused_linear_sums(hidden, head_weight, labels, scale, split, depths,
                                 chunk_size)
    return apply


def depth_targets(labels: torch.Tensor, depths: int,
                  documents: torch.Tensor | None = None) -> torch.Tensor:
    """Whole sequences' labels (B, T) -> (B, 1 + depths, T): the labels, then for each depth
    d the labels d ahead (position i's depth d predicts token i + d + 1, the label at
    i + d), `IGNORE_INDEX` past the end, so every mask the data wrote (chat prompts,
    padding, a document's first token) holds for every depth. `documents` (--doc-mask):
    a position whose depth-d input token lies in a later document is ignored too."""
    rows = [labels]
    for d in range(1, depths + 1):
        ahead = F.pad(labels[:, d:], (0, d), value=IGNORE_INDEX)
        if documents is not None:
            same = F.pad(documents[:, d:] == documents[:, :-d], (0, d), value=False)
            ahead = ahead.masked_fill(~same, IGNORE_INDEX)
        rows.append(ahead)
    return torch.stack(rows, dim=1)


@dataclass(frozen=True)
class Criterion:
    """(last stage's output, targets) -> loss sums over the valid tokens (`sums`).

    Separate from the model's forward, so a pipeline's last stage can apply it to what it
    computed. `hidden`: the output it takes is the final hidden states (the fused head
    projects them), else the logits. `depths`: the model's extra prediction depths (MTP),
    scored against the labels ahead with the same loss as the main rows and added to the
    objective times their weight; each sum is divided, as the main loss's, by the step's
    global count of valid (main) labels.
    """

    mean: LogitsLoss
    hidden: bool = False
    head_sums: Callable[[torch.Tensor], HeadApply] | None = None
    """fused-linear: targets -> the sums the head computes on its weight (`fused_sums`),
    `head(h, apply=...)`; None: `mean` over the model's output."""
    head: nn.Module | None = None
    """The head `head_sums` runs in when it does not run inside the forward."""
    in_forward: bool = False
    """`head_sums` runs inside the model's forward (`ctx.head_apply`, `model_sums`)."""
    depths: Depths = NO_DEPTHS

    def __call__(self, output: torch.Tensor,
                 labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(main loss sum, with gradient; valid count) of an output without extra depths."""
        return self.sums(output, labels)[0], (labels != IGNORE_INDEX).sum()

    def sums(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(3,): the objective, the main rows' loss sum and the depths' (`scored_sums`)."""
        if self.head_sums is not None:
            return self.head(output, apply=self.head_sums(targets))
        return scored_sums(self.mean, output, targets, self.depths.weight)

    @staticmethod
    def objective(sums: torch.Tensor) -> torch.Tensor:
        """What backward trains: the main loss sum plus the depths' times their weight."""
        return sums[0]

    def targets(self, labels: torch.Tensor, training: bool,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """What `sums` scores: the labels, with each depth's below them where the model
        returns its depths (`depth_targets`; training only)."""
        if not (training and self.depths.count):
            return labels
        return depth_targets(labels, self.depths.count, documents)

    def context(self, ctx: ForwardContext | None, depths: bool) -> ForwardContext | None:
        """The forward's context with what this criterion needs of the model added: hidden
        states (fused-linear), the extra depths (where `depths`: training)."""
        depths = depths and self.depths.count > 0
        if not (self.hidden or depths):
            return ctx
        return context_of(ctx).with_(hidden=self.hidden, depths=depths)

    def model_sums(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                   ctx: ForwardContext | None = None) -> torch.Tensor:
        """`sums` of a whole model on `inputs`, its extra depths run where `targets` hold
        theirs (`targets`); the model is called with a context only when there is one, so
        a model without the argument (transformers') is called as before."""
        ctx = self.context(ctx, targets.dim() == 3)
        if self.in_forward and self.head_sums is not None:
            return model(inputs, ctx=context_of(ctx).with_(head_apply=self.head_sums(targets)))
        output = model(inputs) if ctx is None else model(inputs, ctx=ctx)
        return self.sums(output, targets)


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
                    in_forward: bool = False, depths: Depths = NO_DEPTHS) -> Criterion:
    """The criterion of the (already resolved) mode; fused-linear projects through `head`,
    the model's `OutputHead` (None on pipeline stages without it, which never call it).

    `in_forward`: the model takes `ctx.head_apply`, so fused-linear's loss is handed to the
    model's forward (`Criterion.model_sums`) rather than applied to the hidden states it
    returns; the caller says where that holds (one stage, no tp or cp). `depths`: the
    model's extra prediction depths (`ModelSpec.depths`), scored like the main rows."""
    hidden, head_sums = cfg.loss_impl == "fused-linear", None
    if hidden:
        mean = fused_head_loss(head, cfg.loss_chunk_size)
        head_sums = partial(fused_sums, cfg.loss_chunk_size, depths.weight)
        logger.info("loss: fused-linear, %d-row chunks, %s", cfg.loss_chunk_size,
                    f"vocab-parallel over tp {tp}" if tp > 1 else "full vocabulary")
    else:
        criterion = logits_criterion(cfg.loss_impl, cfg.loss_chunk_size)
        vocab_parallel = cfg.loss_impl == "loss-parallel"
        mean = partial(_logits_mean, criterion, vocab_parallel)
        logger.info("loss: %s", cfg.loss_impl)
    if cfg.debug_logits:  # the probe reads logits: the fused head's loss runs as a mean
        mean, head_sums = _LogitsProbe(mean, head, hidden), None
    return Criterion(mean, hidden, head_sums, head, in_forward and head_sums is not None,
                     depths)


def _logits_mean(criterion: LogitsLoss, vocab_parallel: bool, logits: torch.Tensor,
                 labels: torch.Tensor) -> torch.Tensor:
    return criterion(logits if vocab_parallel else localise(logits), labels)


def build_loss(cfg: LossConfig, model: nn.Module, tp: int = 1) -> LossFn:
    """The mean loss of a whole model's main head: its forward, then the criterion."""
    return partial(_model_loss, build_criterion(cfg, output_of(model), tp))


def _model_loss(criterion: Criterion, model: nn.Module, inputs: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
    sums = criterion.model_sums(model, inputs, labels)
    return criterion.objective(sums) / (labels != IGNORE_INDEX).sum()
