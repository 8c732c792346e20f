"""The one place a validated `JobConfig` is rewritten with what start-up learned.

Domain packages return facts (the loss implementation the mesh allows, the LoRA targets a
family expands to, the compile mode CUDA graphs need) and never a config of their own;
the resolvers (`loom.trainer.resolve`, `loom plan`'s) hand them to `settled`, which puts
each fact in the flag of the same name, so every rewrite reads the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loom.config.job import JobConfig, flag_fields, section_values, with_settings
from loom.errors import ConfigError


def refuse_replaced(cfg: JobConfig, facts: Mapping[str, Any], source: str) -> None:
    """Facts a model's source fixes (a Hub folder's shape) must agree with any flag the
    user gave for them: a differing one is refused in one line, never silently replaced
    (`--dim 512` with a 2048-wide folder would train the folder's 2048)."""
    where = flag_fields()
    for name, value in facts.items():
        if name in cfg.explicit and name in where:
            given = section_values(cfg, where[name][0]).get(name)
            if given != value:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} {given}: {source} fixes it at {value}; drop {flag}")


def settled(cfg: JobConfig, notes: tuple[str, ...] = (), **facts: Any) -> JobConfig:
    """`cfg` with each fact set as the flag of its name (a model family's flags too) and
    `notes` added to the warnings the run prints; a name that is no flag is a TypeError, as
    a misspelt field is."""
    if notes:
        cfg = dataclasses.replace(cfg, warnings=(*cfg.warnings, *notes))
    where = flag_fields()
    unknown = sorted(set(facts) - set(where))
    if unknown:
        raise TypeError(f"no flag named {', '.join(unknown)}")
    for section in dict.fromkeys(where[name][0] for name in facts):
        cfg = with_settings(cfg, section, {k: v for k, v in facts.items()
                                           if where[k][0] == section})
    return cfg


@dataclass(frozen=True)
class Facts:
    """What a package learned that the configuration must say: flag values by name and the
    notes (warnings) that explain a change the user did not ask for."""

    settings: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def and_(self, other: Facts) -> Facts:
        """Both; `other`'s value wins where both set a flag."""
        return Facts({**self.settings, **other.settings}, (*self.notes, *other.notes))


def applied(cfg: JobConfig, facts: Facts) -> JobConfig:
    """`cfg` with `facts` settled (`settled`)."""
    return settled(cfg, notes=facts.notes, **facts.settings)
