"""A Hugging Face model's config.json, fetched once per node: every rank of a transformers
run learns the model's shape from it before the model is built."""

from __future__ import annotations

from loom.config import JobConfig
from loom.config.resolved import refuse_replaced
from loom.data.loaders import on_node_leaders
from loom.models.transformers.model import hf_shape, load_hf_config


def hf_model_shape(cfg: JobConfig, local_rank: int) -> dict[str, int]:
    """A transformers model's shape by flag name (none for loom's models). Each node's first rank
    checks the source and fetches the config while the others wait, so every rank fails
    together, with one line, when the model cannot be had."""
    if not cfg.model.runs_transformers:
        return {}
    on_node_leaders(lambda: load_hf_config(cfg.model), leader=local_rank == 0)
    shape = hf_shape(cfg, load_hf_config(cfg.model, cached=True))
    refuse_replaced(cfg, shape, f"--model {cfg.model.model}'s config")
    return shape
