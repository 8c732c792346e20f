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

from loom.config.schema import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LoraConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    OutputConfig,
    ParallelConfig,
    TrainConfig,
)


@dataclass(frozen=True)
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    warnings: tuple[str, ...] = ()
    """Messages produced while resolving the config, logged once by rank 0."""
    explicit: tuple[str, ...] = ()
    """Fields set by a flag or an environment knob, not by a preset or a --config file (a
    resumed run keeps the others from its checkpoint)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.default_factory for f in fields(JobConfig)
            if f.name not in ("warnings", "explicit")}
"""The flag groups of `JobConfig`, by attribute name."""


def flag_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """Every flag's field and its section, by field name (names are unique across sections)."""
    return {f.name: (section, f) for section, factory in SECTIONS.items()
            for f in fields(factory)}
