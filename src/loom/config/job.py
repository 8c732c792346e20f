"""The job configuration as one value: the sections of `loom.config.schema` composed into
`JobConfig`, and the helpers that enumerate its sections and flags.

Kept apart from the schema so that file holds only the flag declarations, one dataclass per
group; what is built on top of the sections (the whole job, the walk over every flag that the
parser, the sources and the reference share) lives here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from loom.config import schema
from loom.config.families import flag_groups


@dataclass(frozen=True)
class JobConfig:
    model: schema.ModelConfig = field(default_factory=schema.ModelConfig)
    parallel: schema.ParallelConfig = field(default_factory=schema.ParallelConfig)
    optim: schema.OptimConfig = field(default_factory=schema.OptimConfig)
    lora: schema.LoraConfig = field(default_factory=schema.LoraConfig)
    train: schema.TrainConfig = field(default_factory=schema.TrainConfig)
    loss: schema.LossConfig = field(default_factory=schema.LossConfig)
    data: schema.DataConfig = field(default_factory=schema.DataConfig)
    output: schema.OutputConfig = field(default_factory=schema.OutputConfig)
    eval: schema.EvalConfig = field(default_factory=schema.EvalConfig)
    checkpoint: schema.CheckpointConfig = field(default_factory=schema.CheckpointConfig)
    warnings: tuple[str, ...] = ()
    """Messages produced while resolving the config, logged once by rank 0."""
    explicit: tuple[str, ...] = ()
    """Fields set by a flag or an environment knob, not by a preset or a --config file (a
    resumed run keeps the others from its checkpoint)."""

    def to_dict(self) -> dict[str, Any]:
        """Every section's flags by name; the families' model flags flat in `model`, as a
        user spells them (config.json, the checkpoint's settings)."""
        return {**dataclasses.asdict(self), "model": self.model.values()}


SECTIONS = {f.name: f.default_factory for f in fields(JobConfig)
            if f.name not in ("warnings", "explicit")}
"""The flag groups of `JobConfig`, by attribute name."""


def section_fields(section: str) -> list[dataclasses.Field]:
    """A section's flags in declaration order; `model`'s are followed by the registered
    families' (`loom.config.families`), which a [model] table and --print-config hold."""
    own = [f for f in fields(SECTIONS[section]) if "help" in f.metadata]
    if section != "model":
        return own
    return own + [f for group in flag_groups() for f in fields(group)]


def flag_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """Every flag's field and its section, by field name (names are unique across sections,
    a family's included)."""
    out: dict[str, tuple[str, dataclasses.Field]] = {}
    for section in SECTIONS:
        for f in section_fields(section):
            if f.name in out:
                raise ValueError(f"the flag {f.name} is declared twice")
            out[f.name] = (section, f)
    return out


def section_values(cfg: JobConfig, section: str) -> dict[str, Any]:
    """A section's flags by name (the families' flat in `model`)."""
    value = getattr(cfg, section)
    return value.values() if section == "model" else \
        {f.name: getattr(value, f.name) for f in section_fields(section)}


def with_settings(cfg: JobConfig, section: str, values: dict[str, Any]) -> JobConfig:
    """`cfg` with flags of one section replaced by name (a family's under `model`)."""
    current = getattr(cfg, section)
    new = current.with_values(**values) if section == "model" else \
        dataclasses.replace(current, **values)
    return dataclasses.replace(cfg, **{section: new})
