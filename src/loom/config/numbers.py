"""Every number a user can set, checked in one place against the range its `flag()`
declares (`loom.config.declare`): flags, environment, a --config file and a `JobConfig`
built in Python pass here alike, first in `validate`, so no later check, model or allocator
meets a nan, a negative size or an integer wider than int64. Each failure is one line that
names the flag.

Also the type of every setting (a `JobConfig` built in Python has no parser in front of it),
and the few ranges that depend on two settings at once."""

from __future__ import annotations

import math
from dataclasses import Field, fields, is_dataclass
from typing import Any

from loom.config.declare import INT64_MAX
from loom.config.families import flag_groups
from loom.config.job import SECTIONS, JobConfig
from loom.errors import ConfigError


def flag_name(f: Field) -> str:
    """The flag a field is set by (and its environment variable, where it has one)."""
    env = f.metadata["env"]
    return f"--{f.name.replace('_', '-')}" + (f" (${env})" if env else "")


def _shown(value: Any) -> str:
    """A value for an error line: an integer too wide to print whole is described."""
    if isinstance(value, int) and abs(value) > 10**30:
        return f"an integer of {value.bit_length()} bits"
    return repr(value) if isinstance(value, str) else str(value)


def _bound(value: float) -> str:
    if value == INT64_MAX:
        return "2^63-1"
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def describe(bounds: tuple) -> str:
    """'>= 1', '> 0', '<= 100' or 'in (0, 1]' for a setting's bounds."""
    ge, gt, le, lt, _ = bounds
    lower = (f"[{_bound(ge)}" if ge is not None else None) if gt is None else f"({_bound(gt)}"
    upper = f"{_bound(le)}]" if le is not None else (f"{_bound(lt)})" if lt is not None else None)
    if lower and upper:
        return f"in {lower}, {upper}"
    if lower:
        return (">= " if lower[0] == "[" else "> ") + lower[1:]
    return ("<= " if upper[-1] == "]" else "< ") + upper[:-1] if upper else ""


def _in_range(value: float, bounds: tuple) -> bool:
    ge, gt, le, lt, finite = bounds
    if math.isnan(value) or (finite and not math.isfinite(value)):
        return False
    return ((ge is None or value >= ge) and (gt is None or value > gt)
            and (le is None or value <= le) and (lt is None or value < lt))


def _violated(value: float, bounds: tuple) -> tuple:
    """The side of the range a number missed (both for nan): what its error line states."""
    ge, gt, le, lt, finite = bounds
    if math.isnan(value) or (finite and math.isinf(value)):
        return bounds
    below = (ge is not None and value < ge) or (gt is not None and value <= gt)
    return (ge, gt, None, None, finite) if below else (None, None, le, lt, finite)


def _check_type(f: Field, value: Any) -> None:
    """The value has the field's type: bool, int (not bool), float (an int is one too),
    str, None where the default is None, a tuple of the type for a repeatable flag."""
    meta, default = f.metadata, f.default
    if default is None and value is None:
        return
    if meta["repeat"]:
        ok = isinstance(value, tuple) and all(type(v) is meta["type"] for v in value)
        kind = f"a tuple of {meta['type'].__name__}"
    else:
        expected = type(default) if default is not None else meta["type"]
        ok = type(value) is expected or (expected is float and type(value) is int)
        kind = {bool: "true or false", int: "an integer", float: "a number",
                str: "a string"}.get(expected, expected.__name__)
    if not ok:
        raise ConfigError(f"{flag_name(f)} must be {kind}, got {type(value).__name__} "
                          f"{_shown(value) if type(value) in (int, float, str) else ''}".rstrip())


def check_value(f: Field, value: Any) -> None:
    """One setting's type and, for a number, its declared range (one line naming the flag);
    an integer is also held to int64 (a seed, a size: what torch takes)."""
    _check_type(f, value)
    if any("\0" in v for v in (value if isinstance(value, tuple) else (value,))
           if isinstance(v, str)):  # a path with one fails in every system call
        raise ConfigError(f"{flag_name(f)} must not hold a NUL byte, got {_shown(value)}")
    most = f.metadata.get("most")
    if f.metadata["repeat"] and most is not None and len(value) > most:
        raise ConfigError(f"{flag_name(f)} may be given at most {most} times, got {len(value)}")
    if type(value) in (int, float):
        _check_range(flag_name(f), value, f.metadata["bounds"],
                     float in (type(f.default), f.metadata["type"]))


def _check_range(name: str, value: float, bounds: tuple, is_float: bool) -> None:
    too_wide = type(value) is int and abs(value) > INT64_MAX
    if too_wide or not _in_range(value, bounds):
        if too_wide and bounds[2] is None:  # the implicit int64 limit was crossed: say so
            bounds = (*bounds[:2], INT64_MAX, *bounds[3:])
        what = describe(_violated(value, bounds))
        if is_float and not (bounds[4] and (bounds[2] is not None or bounds[3] is not None)):
            what = f"{'a finite number' if bounds[4] else 'a number'} {what}".rstrip()
        raise ConfigError(f"{name} must be {what}, got {_shown(value)}")


def check_number(name: str, value: Any, bounds: tuple, integer: bool = False) -> Any:
    """A number that is no flag of its own (a Hub folder's config.json field, one of a
    flag's values) held to its declared `declare.bounds`, with the line a flag would get:
    `name` is what the user can find (`config.json: rope_parameters.beta_fast`). Returns
    the value; a bool or a string is no number, and `integer` wants a whole one."""
    kinds = (int,) if integer else (int, float)
    if type(value) not in kinds:
        shown = _shown(value) if type(value) in (int, float, str) else ""
        raise ConfigError(f"{name} must be {'an integer' if integer else 'a number'}, got "
                          f"{type(value).__name__} {shown}".rstrip())
    _check_range(name, value, bounds, not integer)
    return value


def check_numbers(cfg: JobConfig) -> None:
    """Every section's type, every setting's type and range, the families' flags too."""
    if not isinstance(cfg, JobConfig):
        raise ConfigError(f"the job config must be a JobConfig, got {type(cfg).__name__}")
    for name, factory in SECTIONS.items():
        section = getattr(cfg, name)
        if type(section) is not factory:
            raise ConfigError(f"JobConfig.{name} must be a {factory.__name__}, got "
                              f"{type(section).__name__}")
        for f in fields(section):
            if "help" in f.metadata:  # a flag (ModelConfig.family_args is checked below)
                check_value(f, getattr(section, f.name))
    for args in cfg.model.family_args:
        if not is_dataclass(args) or type(args) not in flag_groups():
            raise ConfigError(f"ModelConfig.family_args holds {type(args).__name__}, not a "
                              "registered family's flags")
        for f in fields(args):
            check_value(f, getattr(args, f.name))

