"""This rank's model parts, built once at start-up: on the meta device, split into pipeline
stages, converted, parallelized, then filled (init or a checkpoint). Apart from trainer.py
because it is the one recipe that order matters in, and the loop never calls it; free
functions of the config, mesh, device and seed, so nothing here holds the trainer."""

from __future__ import annotations

import logging
from functools import partial

import torch
from torch import nn

from loom.config import JobConfig
from loom.hf.load import build_hf_model, open_native_checkpoint
from loom.models.resolve import plain_model
from loom.parallel.init import init_weights, load_weights
from loom.parallel.mesh import ParallelDims
from loom.parallel.parallelize import parallelize
from loom.parallel.pipeline_stages import split_stages
from loom.protocols.extensions import added_parameter_std, convert_model
from loom.runtime.distributed import backend_for

logger = logging.getLogger("loom")


def build_model_parts(cfg: JobConfig, dims: ParallelDims, device: torch.device,
                      seed: int) -> list[nn.Module]:
    """This rank's model parts: the whole model, or its pipeline stages, each built on
    the meta device, parallelized, then filled: by the name-seeded init, or from a
    Hugging Face checkpoint a native family imports (each tensor read by the first rank
    of its mesh and scattered). transformers' module has its own loader."""
    if cfg.model.runs_transformers:
        return log_size(cfg, [build_hf_model(cfg, dims, device, backend_for(device))])
    with torch.device("meta"):
        whole = plain_model(cfg)
        parts = split_stages(whole, cfg.parallel, dims)
    if cfg.model.from_hub_format:
        checkpoint = open_native_checkpoint(cfg, whole)
        fill = partial(load_weights, device=device, read=checkpoint.read, seed=seed,
                       added=added_parameter_std(cfg), fresh=checkpoint.fresh)
    else:
        fill = partial(init_weights, seed=seed, device=device,
                       added=added_parameter_std(cfg))
    for part in parts:
        convert_model(part, cfg)  # float8, QAT...: before tensor parallel sees the modules
        parallelize(part, dims, cfg.parallel,
                    loss_parallel=cfg.loss.loss_impl == "loss-parallel",
                    backend=backend_for(device))
        fill(part)
    return log_size(cfg, parts)


def log_size(cfg: JobConfig, parts: list[nn.Module]) -> list[nn.Module]:
    n_params = sum(p.numel() for part in parts for p in part.parameters())
    logger.info("model: %s, %.2fM parameters in this rank's part(s)",
                cfg.model.model or "custom", n_params / 1e6)
    return parts
