"""A model family's own flags: one frozen dataclass of `flag()` fields per family (or group of
families sharing them), declared in the family's folder and registered here when the family
registers (`loom.models.registry.register`).

`loom.config` cannot import the families (they import it), so the families tell it: the
parser, a --config file's `[model]` table, the environment, `--print-config`, config.json
and the flag reference gather family flags from this list. The flags keep their flat names
(`--n-experts`, `[model] n_experts`): a user does not spell which family owns a flag.

A group may define `check(self, cfg)`: its validation, run by `loom.config.validate` with
the whole job (MoE's expert counts against --ep), raising ConfigError.
"""

from __future__ import annotations

from dataclasses import Field, fields, is_dataclass, replace
from typing import Any

_GROUPS: list[type] = []


def register_flags(group: type) -> type:
    """Add a family's flag dataclass (once; a name another group already declares is
    refused, since flags are matched by name; `loom.config.job.flag_fields` refuses one
    that a section declares)."""
    if group in _GROUPS:
        return group
    if not is_dataclass(group) or not group.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"{group.__name__}: a family's flags are a frozen dataclass")
    taken = {f.name for g in _GROUPS for f in fields(g)}
    clash = sorted(taken & {f.name for f in fields(group)})
    if clash:
        raise ValueError(f"{group.__name__} redeclares the flags {', '.join(clash)}")
    _GROUPS.append(group)
    return group


def flag_groups() -> tuple[type, ...]:
    """The registered families' flag dataclasses, in registration order."""
    return tuple(_GROUPS)


def group_fields() -> dict[str, tuple[type, Field]]:
    """Every family flag's group and field, by name."""
    return {f.name: (g, f) for g in _GROUPS for f in fields(g)}


def group_title(group: type) -> str:
    """A group's heading in `--help` and the reference: its docstring's first line."""
    return (group.__doc__ or group.__name__).strip().splitlines()[0].rstrip(".")



def flat_values(section: Any) -> dict[str, Any]:
    """A ModelConfig's flags by name: its own, then each family group's (registered, or
    held though not registered)."""
    out = {f.name: getattr(section, f.name) for f in fields(section) if "help" in f.metadata}
    held = [type(a) for a in section.family_args if type(a) not in _GROUPS]
    for group in (*_GROUPS, *held):
        args = section.flags_of(group)
        out.update({f.name: getattr(args, f.name) for f in fields(group)})
    return out


def replace_values(section: Any, values: dict[str, Any]) -> Any:
    """A ModelConfig with flags replaced by name; a family's go to its group, which is held
    only where it differs from its defaults (so equal settings make equal configs)."""
    known = group_fields()
    groups = {type(a): a for a in section.family_args}
    for name, value in values.items():
        if name in known:
            group = known[name][0]
            groups[group] = replace(groups.get(group, group()), **{name: value})
    held = tuple(a for g, a in groups.items() if a != g())
    shared = {k: v for k, v in values.items() if k not in known}
    return replace(section, **shared, family_args=held)
