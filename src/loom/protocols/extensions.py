"""Extension points: features that act on every model family without editing the trainer.

- A **model converter** changes each built model part in place on the meta device, before
  tensor parallel and the rest of the recipe (e.g. swapping linears for float8 ones, or
  quantisation-aware-training wrappers). Parameter names it keeps are those the init and
  the checkpoints see.
  A converter that adds parameters (LoRA's adapters) says how they are initialised: they
  are drawn from the seed even when the model's own weights come from a checkpoint.
- A **step hook** runs after every optimizer step (e.g. float8 scale precompute, an EMA
  of the weights, the MoE expert-bias update) and may return metrics for the step's row,
  as device scalars read with the row. Whether the update was applied (a non-finite step
  is skipped on the device) reaches it as a device scalar, `StepContext.applied`: a hook
  whose work must not follow a skipped step masks it with that, never reads it.

Each is registered once with a predicate on the resolved config that says whether the run
uses it; a model family's own step hooks (`ModelSpec.hooks`) are its spec's, used by every
run of that family. The trainer only calls `convert_model` and `after_optimizer_step`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from loom.config import JobConfig
from loom.models.registry import for_config
from loom.models.spec import SpecHook
from loom.runtime.distributed import summed

Enabled = Callable[[JobConfig], bool]


@dataclass(frozen=True)
class StepContext:
    """What a step hook may act on: every parameter this rank holds and the group over
    which per-rank statistics are reduced: the ranks holding different tokens (dp x cp;
    tp and pp ranks see the same ones)."""

    model: nn.Module
    token_group: dist.ProcessGroup
    cfg: JobConfig
    applied: torch.Tensor | None = None
    """1.0 where the optimizer applied this step's update, 0.0 where it skipped a
    non-finite one, on the device; None: the host already knows it was applied."""
    stage_group: dist.ProcessGroup | None = None
    """The pipeline's stages (the ranks holding other layers of the same tokens); None
    without pp. Where a family hook's metrics are per stage (`SpecHook.stages`)."""


@dataclass(frozen=True)
class ModelConverter:
    name: str
    enabled: Enabled
    convert: Callable[[nn.Module, JobConfig], None]
    added_std: Callable[[str, JobConfig], float | None] | None = None
    """For the parameters the converter adds (no checkpoint or Hugging Face folder holds
    them: they are drawn from the seed even when the model is loaded), their initial std
    (0.0: zeros); None for every other name."""
    traced: bool = True
    """Whether `loom plan`'s fake-tensor trace applies it (every built-in converter is
    traced, float8's torchao modules included; a converter fake tensors cannot follow
    says False)."""


@dataclass(frozen=True)
class StepHook:
    name: str
    enabled: Enabled
    run: Callable[[StepContext], dict[str, torch.Tensor | float]]


_CONVERTERS: dict[str, ModelConverter] = {}
_STEP_HOOKS: dict[str, StepHook] = {}


def register_converter(converter: ModelConverter) -> ModelConverter:
    _CONVERTERS[converter.name] = converter
    return converter


def register_step_hook(hook: StepHook) -> StepHook:
    _STEP_HOOKS[hook.name] = hook
    return hook


def active_converters(cfg: JobConfig) -> list[ModelConverter]:
    return [c for c in _CONVERTERS.values() if c.enabled(cfg)]


def _family_hook(hook: SpecHook) -> StepHook:
    def run(context: StepContext) -> dict[str, torch.Tensor | float]:
        applied = context.applied
        if applied is None:
            applied = torch.ones((), device=next(context.model.parameters()).device)
        stages = context.stage_group if hook.stages else None

        def total(t: torch.Tensor) -> torch.Tensor:
            t = summed(t, context.token_group)
            return t if stages is None else summed(t, stages)
        return hook.run(context.model, total, dist.get_world_size(context.token_group),
                        applied)
    return StepHook(hook.name, enabled=lambda cfg: True, run=run)


def active_step_hooks(cfg: JobConfig) -> list[StepHook]:
    """The registered hooks the run enables, then its model family's own."""
    own = [_family_hook(h) for h in for_config(cfg.model).hooks]
    return [*(h for h in _STEP_HOOKS.values() if h.enabled(cfg)), *own]


def convert_model(part: nn.Module, cfg: JobConfig, traced_only: bool = False) -> None:
    """Apply every enabled converter, in registration order, to one model part
    (`traced_only`: those `loom plan` traces)."""
    for converter in active_converters(cfg):
        if converter.traced or not traced_only:
            converter.convert(part, cfg)


def added_parameter_std(cfg: JobConfig) -> Callable[[str], float | None]:
    """The initial std of a parameter an enabled converter added, by name; None for the
    model's own parameters (the model's init or its source fills those)."""
    adders = [c.added_std for c in active_converters(cfg) if c.added_std is not None]

    def std(name: str) -> float | None:
        for added in adders:
            value = added(name, cfg)
            if value is not None:
                return value
        return None
    return std


def after_optimizer_step(context: StepContext) -> dict[str, torch.Tensor | float]:
    """Run every enabled step hook; their metrics, merged."""
    metrics: dict[str, torch.Tensor | float] = {}
    for hook in active_step_hooks(context.cfg):
        metrics.update(hook.run(context))
    return metrics
