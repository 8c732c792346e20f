"""Model presets by name: each family declares its own rows in its folder
(`loom/models/<family>/presets.py`) and they are added here when the family registers
(`loom.models.registry.register`), since `loom.config` cannot import the families."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {}
"""Every registered preset: name -> the flags it sets, in registration order."""

ALIASES: dict[str, str] = {}
"""Other names users type for a preset -> its name."""


def register_presets(family: str, rows: Mapping[str, Mapping[str, Any]],
                     aliases: Mapping[str, str]) -> None:
    """Add a family's presets (again for the same family: replaced); a name another family
    already declares is refused, since `--model NAME` must pick one row."""
    taken = {name for name, row in PRESETS.items() if _owner.get(name) != family}
    clash = sorted(taken & {*rows, *aliases})
    if clash:
        raise ValueError(f"the {family} family redeclares the presets {', '.join(clash)}")
    for name, row in rows.items():
        PRESETS[name] = dict(row)
        _owner[name] = family
    for alias, name in aliases.items():
        ALIASES[alias] = name
        _owner[alias] = family


_owner: dict[str, str] = {}


def is_hf_model(name: str) -> bool:
    """A name with a slash (or a local folder) selects the Hugging Face path, not a preset."""
    return "/" in name


def resolve_preset(name: str) -> tuple[str, dict[str, Any]]:
    """Return the canonical preset name and its fields; raise ValueError listing the choices."""
    canonical = ALIASES.get(name, name)
    if canonical not in PRESETS:
        choices = ", ".join([*PRESETS, *ALIASES])
        raise ValueError(f"unknown model preset {name!r}; choose one of: {choices}")
    return canonical, PRESETS[canonical]
