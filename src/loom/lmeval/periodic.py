"""--eval-tasks during training: the harness's tasks on the training model itself, at the
steps validation runs (every --eval-tasks-every steps and after the last), as metric rows
`eval/<task>/<metric>` and `<run>/eval/tasks-step-N.json`.

Every rank runs the same requests in the same order, so the forwards of a sharded model
(FSDP, tensor parallel) meet in the same collectives; dp ranks do not split the requests.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from loom.config import JobConfig
from loom.data.tokenizers import load_tokenizer, tokenizer_name
from loom.lmeval.harness import metric_rows, run_tasks, task_list, task_manager
from loom.lmeval.model import LoomLM
from loom.safe_io import write_text_atomic

BATCH = 8
"""Sequences per forward (every rank holds the whole batch: its memory is the step's)."""


class TaskEvaluation:
    """The run's tasks, checked when the trainer is built (a wrong name stops the run before
    its first step, on every rank), scored when due."""

    def __init__(self, cfg: JobConfig, model: nn.Module, device: torch.device, outdir: Path,
                 is_main: bool, context: Callable[[], AbstractContextManager] = nullcontext):
        e = cfg.eval
        self.tasks = task_list(e.eval_tasks)
        self.manager = task_manager(self.tasks, e.eval_tasks_include,
                                    cfg.model.trust_remote_code)
        tokenizer = load_tokenizer(tokenizer_name(cfg.data.tokenizer_name, cfg.model.model),
                                   cfg.model.trust_remote_code)
        self.model, self.every, self.limit = model, e.eval_tasks_every, e.eval_tasks_limit
        self.context = context
        hf = getattr(model, "hf", None)  # transformers' module: its config's context
        context = hf.config.max_position_embeddings if hf is not None else cfg.model.max_seq_len
        self.lm = LoomLM(self.logits, tokenizer, context, device, BATCH)  # as loom eval --tasks
        self.outdir, self.is_main, self.seed = outdir / "eval", is_main, cfg.train.seed

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        with self.context():  # the step's autocast at one process (bf16 compute)
            out = self.model(ids)
        return out.full_tensor() if isinstance(out, DTensor) else out  # tp: vocab-sharded

    def maybe_evaluate(self, step: int, final: bool) -> dict[str, float]:
        if not (final or (self.every and step % self.every == 0)):
            return {}
        training = self.model.training
        self.model.eval()
        try:
            results = run_tasks(self.lm, self.tasks, self.manager, self.limit, self.seed)
        finally:
            self.model.train(training)
        rows = metric_rows(results)
        if self.is_main:
            self.outdir.mkdir(parents=True, exist_ok=True)
            record = {"step": step, "tasks": self.tasks, "metrics": rows, **results}
            write_text_atomic(self.outdir / f"tasks-step-{step}.json",
                              json.dumps(record, indent=2, default=str) + "\n")
        return rows
