"""Parallelism applied to a model from outside: TP/SP, activation checkpointing, compile, FSDP2.

The families' own plans live in their folders (`loom/models/<family>/plan.py`) and are
registered with their specs by `loom.families`, which sits above this package: the entry
points (the CLI, `loom.fit`, `loom plan`, export) import it."""
