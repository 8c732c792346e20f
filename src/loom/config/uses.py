"""Used or refused: which model flags each family reads, and the one-line refusal of the
others (issue #65).

A model flag a family does not read is accepted and silently ignored unless something says
so, and a user who set it believes it took effect. Each family declares the model flags it
uses (`ModelSpec.uses`, registered here when the family registers, as its flags are:
`loom.config` cannot import the families); a flag of the model section that the run's family
does not use, given by the user, is refused in one line naming the flag and the family,
before anything is written. The flags that pick the model (`SELECTION`) are every
family's. Flags of the other sections (optimizer, data, outputs, ...) act the same on every
family. `tests/unit/models/test_flag_use.py` walks the whole table.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields

from loom.config.families import flag_groups
from loom.config.job import JobConfig, flag_fields
from loom.errors import ConfigError

SELECTION = frozenset({"model", "family", "model_impl", "model_impl_reason",
                       "trust_remote_code"})
"""Model flags that choose the model rather than shape it: taken by every family."""

_USES: dict[str, frozenset[str]] = {}
_OWN: set[str] = set()
"""loom's own families (what the flag reference's table lists)."""


def register_uses(family: str, uses: frozenset[str] | None, own: bool = False) -> None:
    """Record the model flags `family` uses (None: it declares none, and nothing is
    refused for it, as for a family written before the declaration existed); `own`: one
    of loom's families."""
    if uses is None:
        _USES.pop(family, None)
        return
    model_flags = {name for name, (section, _) in flag_fields().items() if section == "model"}
    unknown = sorted(set(uses) - model_flags)
    if unknown:
        raise ValueError(f"family {family} declares uses of {', '.join(unknown)}: no model "
                         "flag of that name")
    _USES[family] = frozenset(uses) | SELECTION
    if own:
        _OWN.add(family)


def use_table() -> list[str]:
    """The flag reference's table: each model flag (but the selection) against loom's
    families, used or refused."""
    names = [n for n in _USES if n in _OWN]
    lines = ["| flag | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    outside = {f.name for g in flag_groups() if not g.__module__.startswith("loom.")
               for f in fields(g)}  # a family registered from elsewhere (a test's) is not loom's
    for flag in model_flag_names():
        if flag not in SELECTION and flag not in outside:
            cells = ["used" if flag in _USES[n] else "refused" for n in names]
            lines.append(f"| `--{flag.replace('_', '-')}` | " + " | ".join(cells) + " |")
    return lines


def declared_uses(family: str) -> frozenset[str] | None:
    """The model flags `family` uses, selection included (None: undeclared)."""
    return _USES.get(family)


def model_flag_names() -> tuple[str, ...]:
    """Every model-section flag, a registered family's included, in declaration order."""
    return tuple(name for name, (section, _) in flag_fields().items() if section == "model")


def family_of(cfg: JobConfig) -> str | None:
    """The family a config builds, as `loom.models.registry.family_name` decides it, where
    the flags alone say (None for a Hugging Face folder read natively: its family is known
    once `loom.models.resolve.model_choice` reads its config.json)."""
    m = cfg.model
    if m.runs_transformers:
        return "transformers"
    if m.from_hub_format:
        return m.family if m.model_impl_reason is not None else None
    return m.family or ("moe" if m.values().get("n_experts") else "llama")


def refuse_unused(cfg: JobConfig, given: Iterable[str]) -> None:
    """One line for the first model flag in `given` (names the user set) that the config's
    family does not use; nothing for an undeclared or not yet known family."""
    family = family_of(cfg)
    uses = None if family is None else declared_uses(family)
    if uses is None:
        return
    given = set(given)
    unused = [name for name in model_flag_names() if name in given and name not in uses]
    if unused:
        flag = f"--{unused[0].replace('_', '-')}"
        raise ConfigError(f"{flag} is not used by the {family} family (it would change "
                          "nothing); drop it")
