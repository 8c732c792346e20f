"""Validation loss: training's step executor (model parts and criterion) under the same
mesh, without gradients, and `loom eval CHECKPOINT --dataset ...` for a saved model.

The loss is summed over valid tokens and divided once by the global count, exactly as
training reduces it, so a 2-rank dp run and a 1-rank run report the same value.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from loom.checkpoint_trust import read_loop
from loom.config import ConfigError, JobConfig, parse_args
from loom.data.loaders import build_dataloader
from loom.losses import IGNORE_INDEX
from loom.mesh import ParallelDims
from loom.parallel.context import shard_batch
from loom.safe_io import write_text_atomic
from loom.step import StepExecutor

logger = logging.getLogger("loom")


class Evaluator:
    """The first `steps` global batches of a dataset in a fixed order (the same tokens at
    every evaluation, so the curve compares like with like)."""

    def __init__(self, dataset: Dataset, executor: StepExecutor, dims: ParallelDims,
                 device: torch.device, batch_size: int, steps: int, every: int):
        try:
            self.loader = build_dataloader(dataset, batch_size=batch_size, dp_rank=dims.dp_rank,
                                           dp_size=dims.dp_size, seed=0, num_workers=0,
                                           shuffle=False)
        except ConfigError as e:
            raise ConfigError(f"validation data: {e}") from None
        self.steps = min(steps, self.loader.sampler.steps_per_epoch)
        self.executor, self.dims, self.device, self.every = executor, dims, device, every

    def maybe_evaluate(self, step: int, final: bool) -> dict[str, float]:
        """`val/loss` and `val/ppl` when due (every `every` steps and after the last)."""
        if not (final or (self.every and step % self.every == 0)):
            return {}
        return self.evaluate()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        valid = torch.zeros((), device=self.device, dtype=torch.float64)
        for batch in itertools.islice(self.loader, self.steps):
            batch = shard_batch(batch, self.dims)  # this cp rank's part of the sequences
            loss_sum += self.executor.loss_sum(batch).double()  # this rank's owned share
            valid += (batch["labels"] != IGNORE_INDEX).sum().to(self.device)
        packed = torch.stack([loss_sum, valid * self.executor.owns_loss])
        dist.all_reduce(packed)  # one owner per loss-mesh rank: each token counted once
        loss = float(packed[0] / packed[1])
        return {"val/loss": loss, "val/ppl": math.exp(min(loss, 700.0)),
                "val/tokens": int(packed[1])}


def build_evaluator(dataset: Dataset | None, cfg: JobConfig, dims: ParallelDims,
                    executor: StepExecutor, device: torch.device) -> Evaluator | None:
    if dataset is None:
        return None
    return Evaluator(dataset, executor, dims, device, cfg.train.batch_size,
                     cfg.eval.eval_steps, cfg.eval.eval_every)


MODEL_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of",
                "ffn_dim_multiplier", "hidden_dim", "rope_theta", "norm_eps", "max_seq_len")


def eval_config(checkpoint: Path, argv: Sequence[str]) -> JobConfig:
    """Training flags for the data and mesh (with --val-fraction or --val-dataset, those
    are evaluated, else --dataset); the model's shape comes from the checkpoint, and the
    run writes only to `<run>/eval-step-N/`."""
    if not (checkpoint / "loop.json").is_file():
        raise ConfigError(f"loom eval: {checkpoint} is not a loom checkpoint folder")
    shape = read_loop(checkpoint)["model_args"]
    cfg = parse_args([*argv, "--resume", str(checkpoint), "--epochs", "1",
                      "--resume-new-data",  # evaluating other data is the point
                      "--outdir", str(checkpoint.parent.parent / f"eval-{checkpoint.name}")])
    model = replace(cfg.model, **{k: shape[k] for k in MODEL_FIELDS})
    return replace(cfg, model=model, output=replace(cfg.output, metrics=False))


def run_eval(checkpoint: Path, argv: Sequence[str]) -> dict[str, float]:
    """Load the checkpoint through training's own resume path and evaluate --dataset."""
    from loom.runtime import init_distributed, rank_info, teardown
    from loom.train import Trainer

    cfg = eval_config(checkpoint, argv)
    info = rank_info()
    dims = ParallelDims.from_config(cfg.parallel, info.world_size)
    device = init_distributed(info)
    trainer = Trainer(cfg, info, dims, device)
    evaluator = trainer.evaluator or Evaluator(trainer.loader.dataset, trainer.executor, dims,
                                               device, cfg.train.batch_size,
                                               cfg.eval.eval_steps, every=0)
    result = evaluator.evaluate()
    if info.is_main:
        out = trainer.metrics.outdir / "eval.json"
        write_text_atomic(out, json.dumps({"checkpoint": str(checkpoint),
                                           "dataset": cfg.data.dataset, **result}, indent=2)
                          + "\n")
        print(f"{checkpoint}: val/loss {result['val/loss']:.4f}  val/ppl "
              f"{result['val/ppl']:.2f}  over {result['val/tokens']:,} tokens ({out})")
    trainer.close()
    del trainer, evaluator  # collected by teardown, before the process groups go
    teardown()
    return result


def main(argv: Sequence[str]) -> int:
    from loom.logs import setup_logging
    from loom.runtime import rank_info

    rank = rank_info().rank
    setup_logging(rank)
    if not argv or argv[0].startswith("-"):
        asked = bool(argv) and argv[0] in ("-h", "--help")  # else a usage error: stderr
        print("usage: loom eval CHECKPOINT --dataset DATA [--val-fraction F | --val-dataset V] "
              "[training flags: --eval-steps, --batch-size, --seq-len, mesh...]",
              file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    try:
        run_eval(Path(argv[0]), argv[1:])
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # rank-specific: every rank reports its own
        print(f"error (rank {rank}): {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0
