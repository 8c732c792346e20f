"""`loom eval CHECKPOINT --dataset ...`: a saved model's validation loss, through training's
own resume path. Above `loom.trainer` (whose Trainer builds the evaluator it uses), so neither
imports the other inside a function."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from loom.checkpoint.trust import read_loop
from loom.commands.eval_outputs import eval_folder
from loom.config import ConfigError, JobConfig, ModelConfig, parse_args
from loom.config.resolved import settled
from loom.hf.run_checkpoint import run_config
from loom.lmeval import require_lm_eval
from loom.lora.converter import LoraSettings
from loom.parallel.mesh import ParallelDims
from loom.runtime.distributed import RankInfo, process_group, rank_info
from loom.runtime.logs import logging_scope
from loom.safe_io import write_text_new
from loom.trainer.evaluate import Evaluator, Validation, build_validation
from loom.trainer.resolve import resolve_model
from loom.trainer.scoped import training


def eval_argv(checkpoint: Path, argv: Sequence[str]) -> list[str]:
    """Training flags for the data and mesh, resuming `checkpoint` for one pass over data
    other than its own (evaluating other data is the point)."""
    if not (checkpoint / "loop.json").is_file():
        raise ConfigError(f"loom eval: {checkpoint} is not a loom checkpoint folder")
    return [*argv, "--resume", str(checkpoint), "--epochs", "1", "--resume-new-data"]


def eval_settings(checkpoint: Path, flags: JobConfig) -> dict[str, Any]:
    """What the checkpoint and the command decide, by flag name: the model's shape (and a
    LoRA run's adapters) from the checkpoint; every window of each set unless --eval-steps
    limits it (with --val-fraction or --val-dataset those are evaluated, else --dataset);
    the run writes only to `<run>/eval-step-N/` of the checkpoint's resolved run folder,
    or --outdir."""
    loop = read_loop(checkpoint)
    known = ModelConfig().values()  # model_args are named like the model flags (families' too)
    shape = {k: v for k, v in loop["model_args"].items() if k in known}
    if loop["architecture"].get("family"):
        shape["family"] = loop["architecture"]["family"]
    given = flags.output.outdir if "outdir" in flags.explicit else None
    outdir = eval_folder(checkpoint, given, f"eval-{checkpoint.resolve().name}")
    steps = flags.eval.eval_steps if "eval_steps" in flags.explicit else 0  # 0: the whole set
    muon = any(g.get("kind") == "muon" for g in loop["param_groups"])  # resumed, never stepped
    return {**shape, "metrics": False, "outdir": str(outdir), "eval_steps": steps,
            "optimizer": "muon" if muon else "adamw",
            **lora_settings(checkpoint, loop["architecture"])}


def lora_settings(checkpoint: Path, arch: dict) -> dict[str, Any]:
    """A LoRA run's adapters as it trained them, on its base: its checkpoint holds no
    frozen weight, so the run's Hugging Face --model is read again (a base from loom's
    init is drawn from the restored seed). None for a run without adapters."""
    lora = LoraSettings.recorded(arch)
    if lora is None:
        return {}
    found = {"lora_rank": lora.rank, "lora_alpha": lora.alpha,
             "lora_targets": ",".join(lora.targets)}
    base = run_config(checkpoint).get("model", {}).get("model")
    if base is not None and ModelConfig(model=base).from_hub_format:
        found["model"] = base  # checked, as every Hugging Face --model, before ranks start
    return found


def scored_line(checkpoint: Path, name: str, evaluator: Evaluator,
                result: dict[str, float]) -> str:
    """What `loom eval` prints for one set: loss, perplexity and the tokens it scored."""
    p = evaluator.prefix
    extent = "every window" if evaluator.whole else \
        f"the first {evaluator.steps} of {evaluator.batches} global batches"
    return (f"{checkpoint}{f' [{name}]' if name else ''}: {p}loss {result[p + 'loss']:.4f}  "
            f"{p}ppl {result[p + 'ppl']:.2f}  scored {result[p + 'tokens']:,} tokens "
            f"({extent})")


def run_eval(checkpoint: Path, argv: Sequence[str]) -> dict[str, float]:
    """Load the checkpoint through training's own resume path and evaluate --dataset."""
    flags = parse_args(eval_argv(checkpoint, argv))
    cfg = resolve_model(settled(flags, **eval_settings(checkpoint, flags)))
    info = rank_info()
    dims = ParallelDims.from_config(cfg.parallel, info.world_size)  # before any collective
    with process_group(info) as (info, device):
        return evaluate(checkpoint, cfg, info, device, dims)  # its trainer goes first


def evaluate(checkpoint: Path, cfg: JobConfig, info: RankInfo, device: torch.device,
             dims: ParallelDims | None = None) -> dict[str, float]:
    """Evaluate in the started process group; rank 0 writes eval.json and prints."""
    with training(cfg, info, device, dims) as trainer:
        evaluator: Validation = trainer.evaluator or build_validation(
            {"": trainer.loader.dataset}, trainer.executor, trainer.dims, device,
            cfg.train.batch_size, cfg.eval.eval_steps, every=0)
        result = evaluator.evaluate()
        if info.is_main:
            out = write_text_new(trainer.metrics.outdir / "eval.json", json.dumps(
                {"checkpoint": str(checkpoint), "dataset": cfg.data.dataset, **result},
                indent=2) + "\n")  # a second evaluation: eval.1.json, never over the first
            for name, one in evaluator.evaluators.items():
                print(scored_line(checkpoint, name, one, result))
            print(f"written to {out}")
    return result


TASK_FLAGS = ("--tasks", "--eval-tasks")


def asks_for_tasks(argv: Sequence[str]) -> bool:
    """Whether `loom eval` runs benchmark tasks rather than the validation loss."""
    return any(a in TASK_FLAGS or a.split("=", 1)[0] in TASK_FLAGS for a in argv)


def run_tasks_eval(checkpoint: Path, argv: Sequence[str]) -> None:
    """`--tasks`: lm-evaluation-harness on the checkpoint (its module imports the harness,
    so it is imported here, once the harness is known to be installed)."""
    require_lm_eval("loom eval --tasks")
    from loom.commands.eval_tasks import evaluate_checkpoint

    evaluate_checkpoint(checkpoint, argv)


def main(argv: Sequence[str]) -> int:
    rank = rank_info().rank
    with logging_scope(rank):
        return eval_main(argv, rank)


def eval_main(argv: Sequence[str], rank: int) -> int:
    if not argv or argv[0].startswith("-"):
        asked = bool(argv) and argv[0] in ("-h", "--help")  # else a usage error: stderr
        print("usage: loom eval CHECKPOINT --dataset DATA [--val-fraction F] [--val-dataset "
              "[NAME=]PATH ...] [training flags: --eval-steps (default: the whole set), "
              "--batch-size, --seq-len, mesh...]\n       loom eval CHECKPOINT --tasks T1,T2 "
              "[--tasks-include PATH] [--tasks-limit N] (lm-evaluation-harness; one process)",
              file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    tasks = asks_for_tasks(argv[1:])
    try:
        (run_tasks_eval if tasks else run_eval)(Path(argv[0]), argv[1:])
    except ConfigError as e:
        if rank == 0 or tasks:  # each task-eval rank checks for itself
            print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # rank-specific: every rank reports its own
        print(f"error (rank {rank}): {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0
