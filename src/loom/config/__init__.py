"""The job configuration: declared once (schema, composed into one `JobConfig` by job), read
from flags, environment, presets and a --config file (parser, sources, file), validated once
(validate). `loom.trainer.resolve` adds what is learned at start-up and gives the trainer the
final, frozen config."""

from loom.config.job import SECTIONS, JobConfig
from loom.config.parser import HELP_GROUPS, build_parser, parse_args
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
from loom.config.sources import config_from_flags
from loom.config.validate import check_expert_layout, validate
from loom.errors import ConfigError

__all__ = [
    "HELP_GROUPS", "SECTIONS", "CheckpointConfig", "ConfigError", "DataConfig", "EvalConfig",
    "JobConfig", "LoraConfig", "LossConfig", "ModelConfig", "OptimConfig", "OutputConfig",
    "ParallelConfig", "TrainConfig", "build_parser", "check_expert_layout", "config_from_flags",
    "parse_args", "validate",
]
