"""Parallelism applied to a model from outside: TP/SP, activation checkpointing, compile, FSDP2.

Loading the package registers loom's model families with their plans (`families`): every
process that parallelizes a model, and the CLI, reach it."""

from loom.parallel import families  # noqa: F401
