"""A resumed optimizer: what the checkpoint's uses, read back as this run's flags, and the
loaded optimizer set to what this run's config says.

A checkpoint's optimizer groups (loop.json `param_groups`) hold Muon's hyperparameters, and
the scheduler's `base_lrs` each group's peak learning rate. On resume each is kept unless its
flag is given again (`saved_optimizer`, read by `loom.checkpoint.resume.saved_settings`), so
config.json records what the optimizer uses; once the state is loaded, `set_optimizer`
writes this run's values into the groups and the schedule, so the optimizer uses what
config.json says: a value given again takes effect, the others are written back unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loom.config import ConfigError, OptimConfig
from loom.config.optim import ns_coefficients

MUON_KIND = "muon"
"""The `kind` of Muon's group (`loom.trainer.muon.MUON`); AdamW's groups carry none."""
MUON_GROUP = {"muon_momentum": "momentum", "muon_nesterov": "nesterov",
              "muon_ns_steps": "ns_steps", "muon_ns_coefficients": "ns_coefficients",
              "muon_ns_dtype": "ns_dtype", "muon_adjust_lr": "adjust_lr_fn",
              "muon_weight_decay": "weight_decay"}
"""Muon's flags -> the key of its group that holds each (its lr: the schedule's base)."""


def _muon_index(groups: list[dict[str, Any]]) -> int | None:
    return next((i for i, g in enumerate(groups) if g.get("kind") == MUON_KIND), None)


def in_group(name: str, value: Any) -> Any:
    """A flag's value as the optimizer group holds it."""
    if name == "muon_ns_coefficients":
        return ns_coefficients(value)
    if name == "muon_adjust_lr":
        return value.replace("-", "_")
    return value


def as_flag(name: str, value: Any) -> Any:
    """A group's value as its flag says it."""
    if name == "muon_ns_coefficients":
        return ",".join(repr(float(c)) for c in value)
    if name == "muon_adjust_lr":
        return value.replace("_", "-")
    return value


def same(name: str, a: Any, b: Any) -> bool:
    """Whether two values of a flag make the same optimizer (coefficients as numbers)."""
    if name in MUON_GROUP:
        return in_group(name, a) == in_group(name, b)
    return bool(a == b)


def check_kind(loop: dict[str, Any], optimizer: str, path: Path) -> None:
    """The checkpoint's optimizer is this run's --optimizer, refused in one line before
    anything is built (`Checkpointer.load` checks the groups again)."""
    kind = "adamw" if _muon_index(loop["param_groups"]) is None else MUON_KIND
    if kind != optimizer:
        raise ConfigError(f"--resume {path}: the checkpoint's optimizer is {kind}, this "
                          f"run's --optimizer {optimizer}; resume with --optimizer {kind}")


def saved_optimizer(loop: dict[str, Any]) -> dict[str, Any]:
    """Muon's flags as the checkpoint's optimizer uses them, by flag name ({} for AdamW).
    Its lr is the group's scheduled peak; a checkpoint that does not record `muon_lr`
    (written before it was) follows --lr where the peaks agree."""
    groups = loop["param_groups"]
    i = _muon_index(groups)
    if i is None:
        return {}
    found = {name: as_flag(name, groups[i][key]) for name, key in MUON_GROUP.items()}
    settings, peak = loop["settings"], loop["scheduler"]["base_lrs"][i]
    found["muon_lr"] = settings["muon_lr"] if "muon_lr" in settings else \
        None if peak == settings["lr"] else float(peak)
    return found


def set_optimizer(optimizer: Any, scheduler: Any, o: OptimConfig) -> None:
    """Write this run's optimizer flags into the loaded groups and schedule. Every scheduled
    lr is proportional to its group's peak, so a new peak (--lr for AdamW's groups and a
    Muon group that follows it, --muon-lr for one that does not) rescales the group's
    current lr and the scheduler's; the scheduler is changed through its state dict (its
    public interface), never by writing its attributes."""
    state = scheduler.state_dict()
    for i, group in enumerate(optimizer.param_groups):
        muon = group.get("kind") == MUON_KIND
        if muon:
            group.update({key: in_group(name, getattr(o, name))
                          for name, key in MUON_GROUP.items()})
        lr = o.muon_lr if muon and o.muon_lr is not None else o.lr
        peak = state["base_lrs"][i]
        if lr == peak:
            continue
        if peak == 0:
            flag = "--muon-lr" if muon and o.muon_lr is not None else "--lr"
            raise ConfigError(f"{flag} {lr}: the checkpoint was trained at lr 0, whose "
                              "schedule cannot be rescaled; start a new run from it instead")
        scale = lr / peak
        state["base_lrs"][i], state["_last_lr"][i] = lr, state["_last_lr"][i] * scale
        group["lr"] *= scale
        group["initial_lr"] = lr
    scheduler.load_state_dict(state)
