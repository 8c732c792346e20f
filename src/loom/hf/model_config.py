"""A Hugging Face model's config.json, fetched once per node: every rank of a transformers
run learns the model's shape from it before the model is built."""

from __future__ import annotations

from loom.config import JobConfig
from loom.data.loaders import on_node_leaders
from loom.models.transformers.model import load_hf_config, with_hf_config


def resolve_hf_model(cfg: JobConfig, local_rank: int) -> JobConfig:
    """`cfg` with the HF model's shape (no-op for loom's models). Each node's first rank
    checks the source and fetches the config while the others wait, so every rank fails
    together, with one line, when the model cannot be had."""
    if not cfg.model.runs_transformers:
        return cfg
    on_node_leaders(lambda: load_hf_config(cfg.model), leader=local_rank == 0)
    return with_hf_config(cfg, load_hf_config(cfg.model, cached=True))
