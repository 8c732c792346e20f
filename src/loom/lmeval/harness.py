"""Finding and running lm-evaluation-harness tasks on a `LoomLM`, and naming their results
as loom's metric rows (`eval/<task>/<metric>`).

The harness indexes its ~15,000 shipped task configs in tens of seconds, so a run that
names only tasks of its --eval-tasks-include folder indexes that folder alone.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from pathlib import Path
from typing import Any

from lm_eval import simple_evaluate
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager

from loom.config import ConfigError
from loom.lmeval.task_files import check_task_folder

QUIET_LOGGERS = ("lm-eval", "lm_eval")
"""The harness logs each step at INFO; loom shows its warnings only."""

BOOTSTRAP_ITERS = 1000
"""Resamples for the standard error of metrics without a closed form (the harness's default,
100,000, takes minutes on a CPU)."""


def task_list(spec: str | None) -> list[str]:
    """--eval-tasks' names, in order, each once."""
    names = [t.strip() for t in (spec or "").split(",") if t.strip()]
    if not names:
        raise ConfigError("--eval-tasks: name at least one task (comma-separated)")
    return list(dict.fromkeys(names))


def task_manager(tasks: list[str], include: str | None,
                 trust_remote_code: bool = False) -> TaskManager:
    """The harness's task index holding every one of `tasks`, or one line naming those it
    does not know; an `include` folder's YAMLs are checked first (`task_files`)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    if include is not None:
        path = Path(include).expanduser()
        if not path.exists():
            raise ConfigError(f"--eval-tasks-include {include}: no such file or folder")
        check_task_folder(include, trust_remote_code)
        local = TaskManager(include_path=str(path), include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    manager = TaskManager(include_path=include)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or in {include}" if include else " (local configs: --tasks-include PATH)"
        raise ConfigError(f"unknown lm-evaluation-harness task(s) {', '.join(unknown)}: not "
                          f"among the harness's tasks{where}")
    return manager


def run_tasks(lm: LM, tasks: list[str], manager: TaskManager, limit: int = 0,
              seed: int = 0) -> dict[str, Any]:
    """The harness's results of `tasks` (its `results`, `n-samples`, `n-shot` and `versions`
    tables), at most `limit` documents each (0: all)."""
    with contextlib.redirect_stdout(sys.stderr):  # it prints progress; stdout is results
        out = simple_evaluate(model=lm, tasks=tasks, task_manager=manager,
                              limit=limit or None, log_samples=False,
                              bootstrap_iters=BOOTSTRAP_ITERS, random_seed=None,
                              numpy_random_seed=None, torch_random_seed=None,
                              fewshot_random_seed=seed)  # a run's global RNGs stay as they are
    if out is None:  # only a rank other than the harness's first gets None
        return {}
    return {k: out.get(k) for k in ("results", "n-samples", "n-shot", "versions")}


def metric_rows(results: dict[str, Any]) -> dict[str, float]:
    """Each task's numeric results as `eval/<task>/<metric>` (a metric under a filter other
    than the default `none` as `<metric>_<filter>`)."""
    rows: dict[str, float] = {}
    for task, entry in (results.get("results") or {}).items():
        for key, value in entry.items():
            metric, comma, kind = key.partition(",")
            if not comma or isinstance(value, bool) or not isinstance(value, int | float):
                continue  # the name, alias and sample count; "N/A" standard errors
            name = metric if kind in ("", "none") else f"{metric}_{kind}"
            if math.isfinite(value):
                rows[f"eval/{task}/{name}"] = float(value)
    return rows
