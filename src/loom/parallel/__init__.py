"""Parallelism applied to a model from outside: TP/SP, activation checkpointing, compile, FSDP2."""
