"""Pipeline parallel: the model cut into stages, and each stage's input and output shapes
(`loom.trainer.pipeline_executor` hands micro-batches to a `torch.distributed.pipelining` schedule).

Each stage is the model built on the meta device with the layers it does not hold removed,
so parameter names, and with them the name-seeded init, are those of the whole model: every
layout starts from the same weights. Stages are parallelized like a whole model.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from loom.config import JobConfig, ParallelConfig
from loom.config.pipeline_layout import (
    balanced_split,
    stage_indices,
    stages_per_rank,
)
from loom.models.registry import for_model
from loom.models.spec import ModelParts
from loom.numerics.precision import torch_dtype
from loom.parallel.mesh import ParallelDims

logger = logging.getLogger("loom")


def _count(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def model_parts(model: nn.Module) -> ModelParts:
    """The names of the model's embedding, blocks and head (its family spec's)."""
    parts = for_model(model).parts
    if parts is None:
        raise ValueError(f"{type(model).__name__} cannot be cut into pipeline stages")
    return parts


def blocks_of(model: nn.Module) -> nn.ModuleDict:
    return getattr(model, model_parts(model).blocks)


def has_embedding(stage: nn.Module) -> bool:
    name = model_parts(stage).embedding
    return name is not None and getattr(stage, name) is not None


def has_head(stage: nn.Module) -> bool:
    return getattr(stage, model_parts(stage).head[0]) is not None


def layer_costs(model: nn.Module) -> list[float]:
    """Per layer (embedding, each block, head): parameters (memory) plus the parameters a
    token multiplies (FLOPs; the family's block cost); the embedding is a lookup, with no
    FLOPs."""
    spec, parts = for_model(model), model_parts(model)
    active = spec.block_cost or _count
    head = sum(_count(getattr(model, name)) for name in parts.head)
    embedding = _count(getattr(model, parts.embedding)) if parts.embedding else 0
    return [embedding, *(_count(b) + active(b) for b in blocks_of(model).values()), 2 * head]


def stage_module(model: nn.Module, layers: range) -> nn.Module:
    """A copy of the (meta) model holding only `layers` (0: embedding, 1..L: blocks,
    L + 1: the head)."""
    parts = model_parts(model)
    stage, n_blocks = copy.deepcopy(model), len(blocks_of(model))
    if 0 not in layers and parts.embedding is not None:
        setattr(stage, parts.embedding, None)
    blocks = blocks_of(stage)
    for name in [n for i, n in enumerate(blocks_of(model)) if i + 1 not in layers]:
        del blocks[name]
    if n_blocks + 1 not in layers:
        for name in parts.head:
            setattr(stage, name, None)
    return stage


def held_layers(stage: nn.Module, n_blocks: int) -> list[int]:
    """The first and last layer a stage holds, numbered as in `stage_module`."""
    layers = [1 + int(name) for name in blocks_of(stage)]
    if has_embedding(stage):
        layers.insert(0, 0)
    if has_head(stage):
        layers.append(n_blocks + 1)
    return [layers[0], layers[-1]]


def split_stages(model: nn.Module, p: ParallelConfig, dims: ParallelDims) -> list[nn.Module]:
    """This rank's model parts: the model itself without pp, else its stages, cut where
    parameters and FLOPs balance."""
    if not dims.pp_enabled:
        return [model]
    per_rank = stages_per_rank(p)
    ranges = balanced_split(layer_costs(model), dims.pp * per_rank)
    indices = stage_indices(dims.pp_rank, dims.pp, per_rank, p.pp_schedule)
    logger.info("pipeline split (layer 0 = embedding, %d = head): %s; this rank holds "
                "stage(s) %s", len(blocks_of(model)) + 1,
                ", ".join(f"{r.start}-{r.stop - 1}" for r in ranges), indices)
    return [stage_module(model, ranges[i]) for i in indices]


def stage_io(part: nn.Module, cfg: JobConfig, tp: int, microbatch: int, hidden: bool,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A stage's input and output as meta tensors, so the schedule needs no inference pass
    (it would run each stage once more, on uninitialised inputs). Between stages the
    activations are sequence-sharded across tp and in the compute dtype. Under context
    parallel every stage sees this cp rank's shard of each sequence (the trainer shards the
    batch before the schedule), so the lengths are seq_len / cp. A model may pack more
    than the hidden states between stages as further row blocks, one per extra prediction
    depth (`ModelSpec.depths`: the DeepSeek-V3 family's MTP embeddings), and its last
    stage returns the depths' rows below the main ones."""
    seq = cfg.data.seq_len // cfg.parallel.cp
    dim, dtype = cfg.model.dim, torch_dtype(cfg.parallel.dtype)
    rows = microbatch * (1 + for_model(part).depths(part).count)
    act = torch.empty(rows, seq // tp, dim, dtype=dtype, device="meta",
                      requires_grad=True)  # its gradient goes back to the previous stage
    if has_embedding(part):
        inputs = torch.empty(microbatch, seq, dtype=torch.long, device="meta")
    else:
        inputs = act
    if not has_head(part):
        return inputs, act
    width = dim if hidden else cfg.model.vocab_size
    return inputs, torch.empty(rows, seq, width, dtype=dtype, device="meta",
                               requires_grad=True)
