"""The model a checkpoint records: `architecture` is `{family, **args}` and `model_args` the
family's arguments, both checked against that family's own arguments dataclass.

No family's fields are written down here: the family named in the record says which keys
`model_args` must hold (exactly the dataclass's fields) and of which type each is, so a
family registered outside loom (tests/families/gpt2.py) saves and resumes like loom's own.
Checkpoints written before families owned their arguments (a flat Llama record, its
architecture with a `kind`) are read as the same record in the new form (`upgrade`).
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import MISSING, fields
from functools import cache
from typing import Any

import torch

from loom.errors import ConfigError
from loom.models.registry import families, family
from loom.models.spec import ModelSpec


class RecordError(ValueError):
    """One key of the model record out of its family's schema."""


LORA_KEYS = ("lora_rank", "lora_alpha", "lora_targets", "lora_base")
"""The adapters a LoRA run adds (checked by `loom.lora.converter.LoraSettings.recorded`) and
the base they train on (`loom.hf.peft.base_record`)."""
HF_SHAPE = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size")
"""What transformers' module records of its shape, as read from its config.json."""
TRANSFORMERS = "transformers"
MAX_INT = 2**31 - 1
MAX_FLOAT = 1e30
MAX_TEXT = 1000
_LEGACY_FAMILY = {"dense": "llama", "moe": "moe", "hf": TRANSFORMERS}
"""A flat record's `kind` -> the family that wrote it (when it names none)."""


@cache
def _types(args_cls: type) -> dict[str, tuple[type, ...]]:
    """Each field's accepted JSON types (`int | None` -> (int, NoneType))."""
    hints = typing.get_type_hints(args_cls)
    out = {}
    for name, hint in hints.items():
        options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        out[name] = tuple(type(None) if o is None else o for o in options)
    return {name: out[name] for name in (f.name for f in fields(args_cls))}


def _value(value: Any, accepted: tuple[type, ...], where: str) -> None:
    kind = type(value)
    if (kind in accepted and kind is not float) or (kind is int and float in accepted):
        if kind is int and not 0 <= value <= MAX_INT:
            raise RecordError(f"{where} is {value}, not an integer in [0, {MAX_INT}]")
        if kind is str and (not value or len(value) > MAX_TEXT or "\x00" in value):
            raise RecordError(f"{where} is not a name")
        return
    if kind is float and float in accepted:
        if not (math.isfinite(value) and 0 <= value <= MAX_FLOAT):
            raise RecordError(f"{where} is {value!r}, not a finite number in [0, {MAX_FLOAT}]")
        return
    names = " or ".join("null" if t is type(None) else t.__name__ for t in accepted)
    raise RecordError(f"{where} is {value!r}, not {names}")


def check_args(spec: ModelSpec, args: Any) -> None:
    """`model_args` holds exactly the family's fields, each of its declared type."""
    if not isinstance(args, dict):
        raise RecordError("model_args is not an object")
    if spec.args_cls is None:  # transformers' module: loom's dense fields of its shape
        for key, v in args.items():
            _value(v, (int, float, bool, str, type(None)), f"model_args.{key}")
        return
    accepted = _types(spec.args_cls)
    missing, unknown = sorted(accepted.keys() - args.keys()), sorted(args.keys() - accepted.keys())
    if missing:
        raise RecordError(f"model_args lacks {missing[0]} (a field of the {spec.name} family)")
    if unknown:
        raise RecordError(f"model_args has unknown key {unknown[0]!r} (the {spec.name} family "
                          "has no such field)")
    for key, v in args.items():
        _value(v, accepted[key], f"model_args.{key}")
    try:  # the family's own checks of its arguments (sizes it cannot be built with)
        spec.args_cls(**args)
    except (ValueError, TypeError, ArithmeticError) as e:
        raise RecordError(f"model_args are not a {spec.name} model's: {e}") from None


def check_record(arch: Any, args: Any) -> None:
    """The architecture names a registered family, repeats its arguments and adds only a
    LoRA run's settings (transformers' module: its name and shape)."""
    if not isinstance(arch, dict) or not isinstance(arch.get("family"), str):
        raise RecordError("architecture.family is not a name")
    try:
        spec = family(arch["family"])
    except ConfigError:
        names = ", ".join(sorted(s.name for s in families()))
        raise RecordError(f"architecture.family is {arch['family'][:100]!r}, not one of "
                          f"{names}") from None
    check_args(spec, args)
    recorded = HF_SHAPE if spec.args_cls is None else spec.field_names()
    for key, v in arch.items():
        if key in LORA_KEYS or (key == "model" and spec.name == TRANSFORMERS):
            _value(v, (int, str), f"architecture.{key}")
        elif key == "family":
            continue
        elif key not in recorded:
            raise RecordError(f"architecture has unknown key {key!r}")
        elif spec.args_cls is None:
            _value(v, (int,), f"architecture.{key}")
        elif v != args[key] or type(v) is not type(args[key]):
            raise RecordError(f"architecture.{key} is {v!r}, model_args.{key} "
                              f"{args[key]!r}")
    absent = [k for k in (recorded if spec.args_cls is not None else ()) if k not in arch]
    if absent:
        raise RecordError(f"architecture lacks {absent[0]}")


def is_legacy(loop: dict[str, Any]) -> bool:
    """A record written before families owned their arguments (its architecture has a kind)."""
    return isinstance(loop.get("architecture"), dict) and "kind" in loop["architecture"]


def upgrade(loop: dict[str, Any]) -> dict[str, Any]:
    """A flat (Llama-keyed) record in the `{family, **args}` form: fields the family added
    since take their defaults (as the old model was built), derived ones their value."""
    old = loop["architecture"]
    if not isinstance(old.get("kind"), str) or old["kind"] not in _LEGACY_FAMILY:
        raise RecordError(f"architecture.kind is not one of {', '.join(_LEGACY_FAMILY)}")
    name = _LEGACY_FAMILY[old["kind"]] if old["kind"] == "hf" else \
        old.get("family") or _LEGACY_FAMILY[old["kind"]]
    if not isinstance(name, str):
        raise RecordError("architecture.family is not a name")
    arch = {"family": name, **{k: old[k] for k in LORA_KEYS if k in old}}
    args = loop.get("model_args")
    if name == TRANSFORMERS:
        arch.update({k: old[k] for k in ("model", *HF_SHAPE) if k in old})
        return {**loop, "architecture": arch}
    try:
        spec = family(name)
    except ConfigError as e:
        raise RecordError(str(e)) from None
    if spec.args_cls is None or not isinstance(args, dict):
        raise RecordError("model_args is not an object")
    check_args(spec, {**{k: v for k, v in _defaults(spec.args_cls).items() if k not in args},
                      **args})  # types first: the dataclass below runs no checks
    try:
        record = spec.record(spec.args_cls(**args))
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise RecordError(f"model_args do not make a {name} model ({e})") from None
    return {**loop, "model_args": record, "architecture": {**arch, **record}}


def _defaults(args_cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in fields(args_cls) if f.default is not MISSING}


def rebuilt_args(arch: dict[str, Any]) -> Any:
    """The family's arguments from a `{family, **args}` record (resume and export rebuild
    the model from it)."""
    spec = family(arch["family"])
    return spec.args_cls(**{k: arch[k] for k in spec.field_names()})


def parameter_shapes(arch: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The parameter shapes of the model a record describes (built on the meta device)."""
    spec = family(arch["family"])
    with torch.device("meta"):
        model = spec.new(rebuilt_args(arch))
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}
