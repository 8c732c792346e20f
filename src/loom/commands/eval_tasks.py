"""`loom eval CHECKPOINT --tasks T1,T2 [--tasks-include PATH]`: lm-evaluation-harness tasks
on a loom checkpoint, in one process, through loom's own model and the run's tokenizer (any
checkpoint loom loads, no export). The results are printed as JSON and written to
`<run>/eval/tasks-step-N.json` (or --outdir; a later evaluation of the same step adds
`tasks-step-N.1.json`, never replacing one).

Imports the harness: `loom.commands.eval` loads this module only once `require_lm_eval`
found it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from loom.checkpoint.trust import read_loop
from loom.commands.eval_outputs import eval_folder
from loom.commands.generate import load_model
from loom.config import ConfigError, parse_args
from loom.data.tokenizers import load_tokenizer
from loom.lmeval.harness import metric_rows, run_tasks, task_list, task_manager
from loom.lmeval.model import LoomLM
from loom.runtime.distributed import rank_info
from loom.safe_io import write_text_new

BATCH = 8
"""Sequences per forward: the requests of one task are alike in length."""


def check_vocab(width: int, size: int, checkpoint: Path, name: str) -> None:
    """A tokenizer larger than the model's vocabulary would index past its embedding."""
    if size > width:
        raise ConfigError(f"loom eval: {checkpoint} has a vocabulary of {width} tokens but "
                          f"tokenizer {name} has {size}; pass the --tokenizer-name the model "
                          "was trained with")


def evaluate_checkpoint(checkpoint: Path, argv: Sequence[str]) -> dict[str, Any]:
    """Check the tasks (every rank, before anything is loaded), then score them in this
    process; the record written and printed."""
    cfg = parse_args(argv)
    tasks = task_list(cfg.eval.eval_tasks)
    if not (checkpoint / "loop.json").is_file():
        raise ConfigError(f"loom eval: {checkpoint} is not a loom checkpoint folder")
    folder = eval_folder(checkpoint, cfg.output.outdir if "outdir" in cfg.explicit else None,
                         "eval")
    manager = task_manager(tasks, cfg.eval.eval_tasks_include, cfg.model.trust_remote_code)
    if rank_info().world_size > 1:
        raise ConfigError("loom eval --tasks runs in one process: start it without torchrun")
    model, context, recorded = load_model(checkpoint, cfg.model.trust_remote_code)
    tokenizer = load_tokenizer(cfg.data.tokenizer_name or recorded, cfg.model.trust_remote_code)
    with torch.no_grad():
        width = model(torch.zeros(1, 1, dtype=torch.long)).size(-1)
    check_vocab(width, tokenizer.size, checkpoint, tokenizer.name)
    lm = LoomLM(model, tokenizer, context, torch.device("cpu"), batch_size=BATCH)
    step = int(read_loop(checkpoint)["step"])
    results = run_tasks(lm, tasks, manager, cfg.eval.eval_tasks_limit, cfg.train.seed)
    record = {"checkpoint": str(checkpoint), "step": step, "tasks": tasks,
              "metrics": metric_rows(results), **results}
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record, indent=2, default=str) + "\n"  # the harness's numpy scalars
    out = write_text_new(folder / f"tasks-step-{step}.json", text)  # never an earlier one
    print(text, end="")
    print(f"written to {out}", file=sys.stderr)
    return record
