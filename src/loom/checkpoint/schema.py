"""What a checkpoint may restore: the schema of `loop.json` and of the `rng-R.json` files.

A checkpoint's JSON steers the run it resumes: its step names the next checkpoints, its
optimizer groups set the update rule (AdamW's `maximize` turns descent into ascent), its
settings choose the schedule. Checkpoints are downloaded and shared, so nothing in them is
used before every value has the type, range and choice a run of loom could have written;
keys loom never writes are refused. A problem is one line naming the file and the key.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Set
from pathlib import Path
from typing import Any

from loom.checkpoint.model_record import RecordError, check_record, is_legacy, upgrade
from loom.config.job import flag_fields
from loom.errors import ConfigError

MAX_INT = 2**53
"""Above any count a run reaches (and exact in a float), below what breaks arithmetic."""
RUN_SETTINGS = {
    "optim": ("lr", "max_grad_norm", "lr_schedule", "warmup_steps", "min_lr_ratio",
              "decay_fraction"),
    "train": ("epochs", "seed", "max_steps", "skip_nonfinite"),
    "checkpoint": ("checkpoint_interval", "keep_checkpoints", "async_checkpoint",
                   "sigterm_grace_s"),
    "data": ("seq_len", "hf_limit"),
}
"""Kept from the checkpoint on resume unless the flag is given again."""
OPTIMIZER_SETTINGS = {"optim": ("muon_lr",)}
"""Recorded beside the optimizer's groups, which cannot say it: whether Muon's lr is its own
or follows --lr (`loom.checkpoint.optimizer` reads the rest of Muon's from its group)."""
READ_SETTINGS = {"data": ("dataset", "tokenizer_name", "hf_split", "hf_text_column"),
                 "model": ("trust_remote_code",)}
"""What the run reads (which file, which tokenizer, whether a folder's code runs): recorded
in the checkpoint, never taken from it; the command line must say the same."""
SETTING_RANGES: dict[str, tuple[float, float]] = {
    "lr": (0, math.inf), "warmup_steps": (0, MAX_INT), "min_lr_ratio": (0, 1),
    "decay_fraction": (0, 1), "epochs": (1, MAX_INT), "seed": (0, 2**32 - 1),
    "max_steps": (0, MAX_INT), "checkpoint_interval": (0, MAX_INT),
    "keep_checkpoints": (1, MAX_INT), "sigterm_grace_s": (0, 86400.0),
    "seq_len": (1, 2**24), "hf_limit": (0, MAX_INT), "max_grad_norm": (-math.inf, math.inf),
    "muon_lr": (0, math.inf)}
"""Inclusive bounds of the numeric settings (a float must also be finite)."""
_LOOP_KEYS = {"step", "tokens_seen", "samples_seen", "scheduler", "param_groups", "settings",
              "architecture", "model_args"}
_OPTIONAL_LOOP_KEYS = {"global_batch", "mesh", "stream_positions", "mixture"}
_SCHEDULER_KEYS = {"base_lrs", "last_epoch", "_step_count", "_is_initial",
                   "_get_lr_called_within_step", "_last_lr", "lr_lambdas"}
_OPTIONAL_SCHEDULER_KEYS = {"verbose"}
_FLOAT_GROUP_KEYS = {"lr": (0.0, math.inf), "initial_lr": (0.0, math.inf),
                     "eps": (0.0, 1.0), "weight_decay": (0.0, math.inf)}
_FIXED_GROUP_KEYS = {"amsgrad": False, "maximize": False, "capturable": False,
                     "differentiable": False, "decoupled_weight_decay": True}
"""AdamW options loom never changes: any other value is not a loom checkpoint's."""
_CHOICE_GROUP_KEYS = {"foreach": (None, True, False), "fused": (None, True, False)}
_POSITION_KEYS = ("epoch", "piece", "document", "offset")


class SchemaError(ValueError):
    """One value out of schema; the message names the key."""


def _integer(value: Any, where: str, low: int = 0, high: int = MAX_INT) -> int:
    if type(value) is not int or not low <= value <= high:
        raise SchemaError(f"{where} is {value!r}, not an integer in [{low}, {high}]")
    return value


def _number(value: Any, where: str, low: float, high: float) -> float:
    """A finite int or float within [low, high] (JSON writes 1.0 as 1 in some encoders)."""
    if type(value) not in (int, float) or not math.isfinite(value) or \
            not low <= value <= high:
        raise SchemaError(f"{where} is {value!r}, not a finite number in [{low}, {high}]")
    return value


def _object(value: Any, where: str, required: Set[str], optional: Set[str] = frozenset()
            ) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SchemaError(f"{where} is not an object")
    missing, unknown = sorted(required - value.keys()), sorted(value.keys() - required - optional)
    if missing:
        raise SchemaError(f"{where} lacks {missing[0]}")
    if unknown:
        raise SchemaError(f"{where} has unknown key {unknown[0]!r}")
    return value


def _list(value: Any, where: str, item: Callable[[Any, str], Any], length: int | None = None
          ) -> list[Any]:
    if not isinstance(value, list) or (length is not None and len(value) != length):
        expected = f" of {length}" if length is not None else ""
        raise SchemaError(f"{where} is not a list{expected}")
    for i, v in enumerate(value):
        item(v, f"{where}[{i}]")
    return value


def check_setting(name: str, value: Any, where: str) -> None:
    """A run setting has its flag's type, one of its choices and a value in its range."""
    _, f = flag_fields()[name]
    kind = f.metadata["type"] or type(f.default)
    if value is None and f.default is None:
        return
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind:
        raise SchemaError(f"{where} is {value!r}, not a {kind.__name__}")
    if f.metadata["choices"] and value not in f.metadata["choices"]:
        raise SchemaError(f"{where} is {value!r}; loom writes one of "
                          f"{', '.join(f.metadata['choices'])}")
    if kind is str and (not value or "\x00" in value):
        raise SchemaError(f"{where} is an empty or NUL-holding string")
    if name in SETTING_RANGES and kind is int:
        _integer(value, where, *(int(min(b, MAX_INT)) for b in SETTING_RANGES[name]))
    elif name in SETTING_RANGES and kind is float:
        _number(value, where, *SETTING_RANGES[name])


def _settings(value: Any) -> None:
    required = {n for names in (*RUN_SETTINGS.values(), READ_SETTINGS["data"]) for n in names}
    settings = _object(value, "settings", required,
                       {*READ_SETTINGS["model"], *OPTIMIZER_SETTINGS["optim"]})
    for name, v in settings.items():
        check_setting(name, v, f"settings.{name}")


_MUON_GROUP_KEYS = {"params", "kind", "lr", "weight_decay", "momentum", "nesterov",
                    "ns_coefficients", "ns_steps", "eps", "adjust_lr_fn", "ns_dtype"}
_MUON_CHOICES = {"kind": ("muon",), "nesterov": (True, False),
                 "adjust_lr_fn": ("match_rms_adamw", "original"), "ns_dtype": ("bf16", "fp32")}


def _muon_group(group: dict[str, Any], where: str) -> None:
    """A Muon group (`loom.trainer.muon`): its hyperparameters in the flags' ranges."""
    _object(group, where, _MUON_GROUP_KEYS, {"initial_lr"})
    for key, (low, high) in _FLOAT_GROUP_KEYS.items():
        if key in group:
            _number(group[key], f"{where}.{key}", low, high)
    _number(group["momentum"], f"{where}.momentum", 0.0, 0.999999)
    _integer(group["ns_steps"], f"{where}.ns_steps", 1, 99)
    _list(group["ns_coefficients"], f"{where}.ns_coefficients",
          lambda v, w: _number(v, w, -1e6, 1e6), 3)
    for key, choices in _MUON_CHOICES.items():
        if not any(group[key] == c and type(group[key]) is type(c) for c in choices):
            raise SchemaError(f"{where}.{key} is {group[key]!r}, not one of {choices}")
    _list(group["params"], f"{where}.params", _name)


def _param_group(value: Any, where: str) -> None:
    if isinstance(value, dict) and "kind" in value:
        _muon_group(value, where)
        return
    group = _object(value, where, {"params", "lr", "betas", "eps", "weight_decay"},
                    {"initial_lr", *_FIXED_GROUP_KEYS, *_CHOICE_GROUP_KEYS})
    for key, (low, high) in _FLOAT_GROUP_KEYS.items():
        if key in group:
            _number(group[key], f"{where}.{key}", low, high)
    _list(group["betas"], f"{where}.betas", _beta, 2)
    for key, expected in _FIXED_GROUP_KEYS.items():
        if key in group and group[key] is not expected:
            raise SchemaError(f"{where}.{key} is {group[key]!r}; loom's AdamW always has "
                              f"{str(expected).lower()}")
    for key, choices in _CHOICE_GROUP_KEYS.items():
        if key in group and not any(group[key] is c for c in choices):
            raise SchemaError(f"{where}.{key} is {group[key]!r}, not true, false or null")
    _list(group["params"], f"{where}.params", _name)


def _name(value: Any, where: str) -> None:
    if not isinstance(value, str) or not value or len(value) > 1000:
        raise SchemaError(f"{where} is not a parameter name")


def _scheduler(value: Any, groups: int) -> None:
    s = _object(value, "scheduler", _SCHEDULER_KEYS, _OPTIONAL_SCHEDULER_KEYS)
    _list(s["base_lrs"], "scheduler.base_lrs", _learning_rate, groups)
    _list(s["_last_lr"], "scheduler._last_lr", _learning_rate, groups)
    _integer(s["last_epoch"], "scheduler.last_epoch", -1)
    _integer(s["_step_count"], "scheduler._step_count")
    for key in ("_is_initial", "_get_lr_called_within_step", "verbose"):
        if key in s and not isinstance(s[key], bool):
            raise SchemaError(f"scheduler.{key} is {s[key]!r}, not true or false")
    _list(s["lr_lambdas"], "scheduler.lr_lambdas", _null, groups)


def _learning_rate(value: Any, where: str) -> None:
    _number(value, where, 0.0, math.inf)


def _byte(value: Any, where: str) -> None:
    _integer(value, where, 0, 255)


def _word(value: Any, where: str) -> None:
    _integer(value, where, 0, 2**32 - 1)


def _beta(value: Any, where: str) -> None:
    _number(value, where, 0.0, 0.999999)


def _null(value: Any, where: str) -> None:
    if value is not None:
        raise SchemaError(f"{where} is {value!r}; loom's schedules are functions, saved as "
                          "null")


def _positions(value: Any) -> None:
    if not isinstance(value, dict) or len(value) > 1 << 20:
        raise SchemaError("stream_positions is not an object")
    for rank, position in value.items():
        if not rank.isdigit():
            raise SchemaError(f"stream_positions has key {rank!r}, not a rank")
        _object(position, f"stream_positions.{rank}", set(_POSITION_KEYS))
        for key in _POSITION_KEYS:
            _integer(position[key], f"stream_positions.{rank}.{key}")


def _mixture(value: Any) -> None:
    """A weighted mixture's record (`loom.data.mixture.mixture_state`)."""
    mix = _object(value, "mixture", {"policy", "sources"})
    if not isinstance(mix["policy"], str) or not isinstance(mix["sources"], list) \
            or not 1 <= len(mix["sources"]) <= 1 << 10:
        raise SchemaError("mixture is not a policy and a list of sources")
    for i, source in enumerate(mix["sources"]):
        source = _object(source, f"mixture.sources.{i}", {"name", "weight", "windows"})
        if not isinstance(source["name"], str) or not isinstance(source["weight"], str) \
                or len(source["name"]) + len(source["weight"]) > 4096:
            raise SchemaError(f"mixture.sources.{i}: name and weight are not strings")
        _integer(source["windows"], f"mixture.sources.{i}.windows")


def check_loop(loop: Any) -> None:
    """loop.json against its schema (SchemaError names the first key out of it)."""
    loop = _object(loop, "loop.json", _LOOP_KEYS, _OPTIONAL_LOOP_KEYS)
    for key in ("step", "tokens_seen", "samples_seen"):
        _integer(loop[key], key)
    if "global_batch" in loop:
        _integer(loop["global_batch"], "global_batch", 1)
    if "mesh" in loop:
        if not isinstance(loop["mesh"], dict):
            raise SchemaError("mesh is not an object")
        for dim, degree in loop["mesh"].items():
            _integer(degree, f"mesh.{dim}", 1, 1 << 20)
    if "stream_positions" in loop:
        _positions(loop["stream_positions"])
    if "mixture" in loop:
        _mixture(loop["mixture"])
    _settings(loop["settings"])
    _list(loop["param_groups"], "param_groups", _param_group)
    if not loop["param_groups"]:
        raise SchemaError("param_groups is empty")
    _scheduler(loop["scheduler"], len(loop["param_groups"]))
    try:
        check_record(loop["architecture"], loop["model_args"])
    except RecordError as e:
        raise SchemaError(str(e)) from None


def checked_loop(loop: Any) -> dict[str, Any]:
    """loop.json checked (`check_loop`), a record of the flat form before families owned
    their arguments read in the `{family, **args}` form."""
    if isinstance(loop, dict) and is_legacy(loop):
        try:
            loop = upgrade(loop)
        except RecordError as e:
            raise SchemaError(str(e)) from None
    check_loop(loop)
    return loop


RNG_WORDS = 625
"""Python's Mersenne Twister state: 624 words and the position (at most 624)."""


def check_rng(state: Any, torch_bytes: int, cuda_bytes: int | None) -> None:
    """An rng-R.json: Python's state, and torch's (and CUDA's) generator bytes of this
    build's length."""
    state = _object(state, "rng", {"python", "torch"}, {"cuda"})
    py = state["python"]
    if not isinstance(py, list) or len(py) != 3 or py[0] != 3:
        raise SchemaError("rng.python is not [3, words, gauss]")
    _list(py[1], "rng.python[1]", _word, RNG_WORDS)
    if py[1][-1] > 624:
        raise SchemaError("rng.python[1] position is past 624")
    if py[2] is not None:
        _number(py[2], "rng.python[2]", -math.inf, math.inf)
    _list(state["torch"], "rng.torch", _byte, torch_bytes)
    if "cuda" in state and cuda_bytes is not None:
        _list(state["cuda"], "rng.cuda", _byte, cuda_bytes)


def _shown(value: Any) -> str:
    """A flag's value as the message names it (a switch: given or not)."""
    if value is None or value is False:
        return "not given"
    return "given" if value is True else str(value)


def check_read_settings(saved: Mapping[str, Any], current: Mapping[str, Any],
                        path: Path, new_data: bool) -> list[str]:
    """Settings that choose what is read must be what this command line says (`current`):
    ConfigError naming the first difference; with `new_data` (--resume-new-data) the data
    may differ, and the differences are returned for the log line."""
    differences = []
    for section, names in READ_SETTINGS.items():
        for name in (n for n in names if n in saved):
            if saved[name] == current[name]:
                continue
            difference = (f"--{name.replace('_', '-')}: checkpoint {_shown(saved[name])}, "
                          f"this run {_shown(current[name])}")
            if not new_data or section == "model":
                hint = ("pass --resume-new-data to continue on other data"
                        if section == "data" else "give the same flag again")
                raise ConfigError(f"--resume {path}: what the run reads differs from the "
                                  f"checkpoint's: {difference}; {hint}")
            differences.append(difference)
    return differences
