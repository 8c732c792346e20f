"""Resuming a run: which checkpoint, the run settings it brings back, and whether this run's
model is the one it holds. All of it happens before the dataset and model are built."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loom.checkpoint.layout import checkpoint_dir, complete_checkpoints, is_step_dir, step_of
from loom.checkpoint.model_record import HF_SHAPE, LORA_KEYS, TRANSFORMERS, parameter_shapes
from loom.checkpoint.optimizer import check_kind, same, saved_optimizer
from loom.checkpoint.schema import (
    OPTIMIZER_SETTINGS,
    READ_SETTINGS,
    RUN_SETTINGS,
    SchemaError,
    check_read_settings,
    check_rng,
)
from loom.checkpoint.trust import UnusableCheckpoint, read_json, read_loop, verify_checkpoint
from loom.config import ConfigError, JobConfig
from loom.config.job import flag_fields
from loom.models.registry import for_config

logger = logging.getLogger("loom")

@dataclass(frozen=True)
class ResumePoint:
    path: Path
    saved: dict[str, Any]
    """The checkpoint's loop.json: loop, scheduler and optimizer state, settings, model."""
    run_id: str


def resume_after_restart(cfg: JobConfig, restarts: int) -> tuple[str | None, str | None]:
    """(the --resume a restarted job takes, or None to keep its own; the note that says
    so). A restarted job (torchrun's --max-restarts, a Slurm requeue) continues its own run
    from the newest complete checkpoint in --outdir, as `--resume auto` would, without the
    user adding the flag: the restarted command line is the one that started the job. An
    explicit --resume wins; without --outdir every attempt would get a new folder, so the
    restart says it starts over."""
    if restarts == 0 or cfg.checkpoint.resume is not None:
        return None, None
    if cfg.output.outdir is None:
        return None, (f"restart {restarts} of this job starts a new run: pass --outdir so "
                      "that a restart continues the same run folder")
    return "auto", (f"restart {restarts} of this job: continuing from the newest complete "
                    f"checkpoint in {cfg.output.outdir} (--resume auto)")


def new_run_id() -> str:
    """Chosen by rank 0, shared with every rank; marks the checkpoints this run may prune."""
    chosen = [uuid.uuid4().hex[:12]]
    dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


def _gather(problems: list[str]) -> list[str]:
    shared: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shared, problems)
    return [p for found in shared for p in found]


def rng_problems(path: Path, names: list[str]) -> list[str]:
    """Which of the checkpoint's RNG files are out of schema for this build of torch."""
    torch_bytes = torch.get_rng_state().numel()
    cuda_bytes = torch.cuda.get_rng_state().numel() if torch.cuda.is_available() else None
    problems = []
    for name in names:
        try:
            check_rng(read_json(path, name), torch_bytes, cuda_bytes)
        except (SchemaError, UnusableCheckpoint) as e:
            problems.append(f"{name} {e}")
    return problems


def open_checkpoint(path: Path) -> ResumePoint:
    """Verify a checkpoint (collective) and read its loop state; every value it restores is
    checked against `loom.checkpoint.schema` first (each rank checks a share of the RNG
    files, and all raise the same error)."""
    manifest = verify_checkpoint(path, dist.get_rank(), dist.get_world_size(), _gather)
    saved = read_loop(path)
    if is_step_dir(path) and step_of(path) != saved["step"]:
        raise UnusableCheckpoint(f"checkpoint {path} is unsafe: loop.json has step "
                                 f"{saved['step']}, its folder {path.name}")
    rngs = sorted(n for n in manifest["files"] if n.startswith("rng-"))
    problems = _gather(rng_problems(path, rngs[dist.get_rank()::dist.get_world_size()]))
    if problems:
        raise UnusableCheckpoint(f"checkpoint {path} is unsafe: {problems[0]}")
    return ResumePoint(path, saved, str(manifest.get("run_id")))


def _with_hint(error: UnusableCheckpoint, path: Path) -> UnusableCheckpoint:
    """Name the newest older checkpoint of the same folder in the message."""
    older = [p for p in complete_checkpoints(path.parent.parent) if step_of(p) < step_of(path)] \
        if path.parent.name == "checkpoints" and path.name.startswith("step-") else []
    hint = f"; resume from {older[-1].name} with --resume {older[-1]}" if older else ""
    return UnusableCheckpoint(f"{error}{hint}")


def find_resume(resume: str | None, outdir: Path) -> ResumePoint | None:
    """None: a new run. `auto`: the newest usable checkpoint in the run folder, if any;
    `latest` (bare --resume): the same, but there must be one; else a checkpoint folder.
    A corrupt newest checkpoint is skipped with a warning in favour of an older one."""
    if resume is None:
        return None
    if resume not in ("auto", "latest"):
        path = Path(resume)
        if not path.is_dir():
            raise ConfigError(f"--resume {resume}: no such checkpoint folder")
        try:
            return open_checkpoint(path)
        except UnusableCheckpoint as e:
            raise _with_hint(e, path) from None
    found = complete_checkpoints(outdir)
    if not found and resume == "latest":
        raise ConfigError(f"--resume: no checkpoint in {checkpoint_dir(outdir)} to resume "
                          "from (--resume auto starts a new run when there is none)")
    errors = []
    for path in reversed(found):
        try:
            point = open_checkpoint(path)
        except UnusableCheckpoint as e:
            logger.warning("--resume %s: skipping %s (%s)", resume, path.name, e)
            errors.append(e)
            continue
        return point
    if errors:
        raise UnusableCheckpoint(f"--resume {resume}: no usable checkpoint in "
                                 f"{checkpoint_dir(outdir)}; the newest: {errors[0]}")
    logger.info("--resume auto: no checkpoint in %s, starting a new run", checkpoint_dir(outdir))
    return None


def set_aside_later(outdir: Path, resumed: Path, step: int) -> Path | None:
    """After `--resume PATH` at `step`, the run folder's checkpoints past that step belong
    to the branch this run abandons: moved into `checkpoints/abandoned-<time>/` (kept, but
    no longer `step-N`), so `--resume auto` continues the new branch, never the old one.
    Returns that folder, or None when there was nothing to move."""
    later = [p for p in complete_checkpoints(outdir)
             if step_of(p) > step and p.resolve() != resumed.resolve()]
    if not later:
        return None
    aside = checkpoint_dir(outdir) / f"abandoned-{datetime.now():%Y%m%d-%H%M%S-%f}"
    aside.mkdir()
    for path in later:
        path.rename(aside / path.name)
    return aside


def run_settings(cfg: JobConfig) -> dict[str, Any]:
    """What a checkpoint records: the run settings it restores, and what the run read."""
    return {name: getattr(getattr(cfg, section), name)
            for group in (RUN_SETTINGS, OPTIMIZER_SETTINGS, READ_SETTINGS)
            for section, names in group.items() for name in names}


def _shown(name: str, value: Any) -> str:
    return "(--lr)" if name == "muon_lr" and value is None else str(value)


def saved_settings(cfg: JobConfig, loop: dict[str, Any], path: Path) -> dict[str, Any]:
    """The checkpoint's run settings this run takes back, by flag name: its loop settings
    and the optimizer's (`loom.checkpoint.optimizer`), all but those given again; what the
    run reads must be what the command line says (`check_read_settings`), and the optimizer
    this run's --optimizer. One info line lists every restored setting and every difference;
    `loom.trainer.resolve` settles and validates them with the other start-up facts."""
    saved = loop["settings"]
    changed = check_read_settings(saved, run_settings(cfg), path,
                                  cfg.checkpoint.resume_new_data)
    check_kind(loop, cfg.optim.optimizer, path)
    where = flag_fields()
    restorable = {**{n: saved[n] for names in RUN_SETTINGS.values() for n in names
                     if n in saved}, **saved_optimizer(loop)}
    kept: dict[str, Any] = {}
    for name, value in restorable.items():
        now = getattr(getattr(cfg, where[name][0]), name)
        if name not in cfg.explicit:
            kept[name] = value
        elif not same(name, now, value):
            changed.append(f"--{name.replace('_', '-')} {_shown(name, value)} -> "
                           f"{_shown(name, now)}")
    restored = ", ".join(f"{n} {_shown(n, v)}" for n, v in kept.items()) or "none"
    logger.info("resume: restored from %s: %s%s", path.name, restored,
                f"; given again: {', '.join(changed)}" if changed else "")
    return kept


def architecture(cfg: JobConfig, args: Any) -> dict[str, Any]:
    """The model a checkpoint holds, `{family, **args}`: its family and every one of the
    family's arguments (transformers' module: its name and the shape read from it), and a
    LoRA run's adapters."""
    m = cfg.model
    spec = for_config(m)
    arch: dict[str, Any] = {"family": spec.name}
    if m.runs_transformers:
        arch.update(model=m.model, **{f: getattr(args, f) for f in HF_SHAPE})
    else:
        arch.update(spec.record(args))
    lo = cfg.lora
    if lo.lora_rank:  # the adapters' shapes, and the scale an export merges with
        arch.update(lora_rank=lo.lora_rank, lora_alpha=repr(float(lo.lora_alpha)),
                    lora_targets=lo.lora_targets)  # (alpha as text: its exact digits)
        if lo.lora_base is not None:  # which base they train on (`loom.hf.peft.base_record`)
            arch["lora_base"] = lo.lora_base
    return arch


TRAINING_ARGS = frozenset({"max_seq_len", "load_balance_coeff", "aux_loss_coeff",
                           "mtp_loss_weight"})
"""Model arguments that weigh the training, not what the model computes (the RoPE table's
length, the expert-bias step, auxiliary losses' weights): a resume may change them."""


def check_architecture(saved: dict[str, Any], current: dict[str, Any],
                       change_model: bool = False) -> list[str]:
    """One line naming the first field where the checkpoint's model and this run's differ:
    the family, the adapters and their base, and every argument that changes a parameter's
    shape (both models rebuilt from their records on the meta device) are refused; an
    argument that changes what the model computes but no shape (RoPE's base, the router's
    top-k) only with `change_model` (--resume-change-model). Returns the differences the
    run takes (`TRAINING_ARGS`, and those --resume-change-model allowed), which it logs."""
    fixed = ("family", *(k for k in LORA_KEYS if k != "lora_base"), "model")
    if saved.get("family") == TRANSFORMERS:
        fixed = tuple(k for k in dict.fromkeys([*saved, *current]) if k != "lora_base")
    for field in fixed:
        if saved.get(field) != current.get(field):
            _differ(field, saved, current)
    _check_base(saved.get("lora_base"), current.get("lora_base"))
    if saved["family"] == TRANSFORMERS:
        return []
    shapes = parameter_shapes(saved)
    differ = [f for f in dict.fromkeys([*saved, *current])
              if f != "lora_base" and saved.get(f) != current.get(f)]
    if shapes != parameter_shapes(current):
        for field in differ:  # the first whose change alone reshapes a parameter
            if parameter_shapes({**saved, field: current.get(field)}) != shapes:
                _differ(field, saved, current)
        _differ(differ[0], saved, current)
    meaning = [f for f in differ if f not in TRAINING_ARGS]
    if meaning and not change_model:
        f = meaning[0]
        raise ConfigError(f"--resume: checkpoint has {f} {saved.get(f)}, this run "
                          f"{current.get(f)}, which changes what the model computes; give "
                          "the checkpoint's model flags, or pass --resume-change-model to "
                          "train on with the change")
    changes = [f"{f} {saved.get(f)} -> {current.get(f)}" for f in differ]
    if changes:
        logger.info("resume: the model's arguments given again: %s", ", ".join(changes))
    return changes


def describe_base(record: str | None) -> str:
    """A LoRA base record (`loom.hf.peft.base_record`) as a message names it."""
    if record is None:
        return "an unrecorded base"
    return f"loom's init from seed {record[5:]}" if record.startswith("init:") else record


def _check_base(saved: str | None, current: str | None) -> None:
    """The base a LoRA checkpoint's adapters were trained on is the one this run reads (a
    checkpoint written before bases were recorded names none: nothing to compare)."""
    if saved is not None and saved != current:
        raise ConfigError(f"--resume: the checkpoint's adapters were trained on the base "
                          f"{describe_base(saved)}, this run's base is "
                          f"{describe_base(current)}; resume on the checkpoint's base")


def _differ(field: str, saved: dict[str, Any], current: dict[str, Any]) -> None:
    raise ConfigError(f"--resume: checkpoint has {field} {saved.get(field)}, this run "
                      f"{current.get(field)}; give the checkpoint's model flags")
