"""Benchmark tasks through lm-evaluation-harness, an optional extra (`pip install
'loom[eval]'`): `model` wraps loom's model as the harness's `LM`, `harness` finds and runs
tasks. Both import `lm_eval`, so they are imported inside the functions here (and
`loom.commands.eval`'s), once `require_lm_eval` found the extra: loom runs without it until
tasks are asked for."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from loom.config import ConfigError, JobConfig


def require_lm_eval(flag: str) -> ModuleType:
    """`loom.lmeval.harness`, or one line saying how to install what it needs."""
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(f"{flag} needs lm-evaluation-harness, which is not installed: "
                          "pip install 'loom[eval]' (or lm_eval>=0.4)")
    from loom.lmeval import harness  # imports lm_eval: only now that it is known installed

    return harness


def build_task_evaluation(cfg: JobConfig, model: nn.Module, device: torch.device,
                          outdir: Path, is_main: bool,
                          context: Callable[[], AbstractContextManager] = nullcontext) -> Any:
    """The run's --eval-tasks (a `loom.lmeval.periodic.TaskEvaluation`), None without;
    `context`: what the model's forward runs in (the step's autocast at one process)."""
    if not cfg.eval.eval_tasks:
        return None
    require_lm_eval("--eval-tasks")
    from loom.lmeval.periodic import TaskEvaluation  # imports lm_eval (found above)

    return TaskEvaluation(cfg, model, device, outdir, is_main, context)
