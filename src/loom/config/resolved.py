"""The one place a validated `JobConfig` is rewritten with what start-up learned.

Domain packages return facts (the loss implementation the mesh allows, the LoRA targets a
family expands to, the compile mode CUDA graphs need) and never a config of their own;
the resolvers (`loom.trainer.resolve`, `loom plan`'s) hand them to `settled`, which puts
each fact in the flag of the same name, so every rewrite reads the same.
"""

from __future__ import annotations

from typing import Any

from loom.config.job import JobConfig, flag_fields, with_settings


def settled(cfg: JobConfig, **facts: Any) -> JobConfig:
    """`cfg` with each fact set as the flag of its name (a model family's flags too); a
    name that is no flag is a TypeError, as a misspelt field is."""
    where = flag_fields()
    unknown = sorted(set(facts) - set(where))
    if unknown:
        raise TypeError(f"no flag named {', '.join(unknown)}")
    for section in dict.fromkeys(where[name][0] for name in facts):
        cfg = with_settings(cfg, section, {k: v for k, v in facts.items()
                                           if where[k][0] == section})
    return cfg
