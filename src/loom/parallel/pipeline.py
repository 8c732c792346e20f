"""Pipeline parallel: the model cut into stages and an executor that hands micro-batches to
a `torch.distributed.pipelining` schedule.

Each stage is the model built on the meta device with the layers it does not hold removed,
so parameter names, and with them the name-seeded init, are those of the whole model: every
layout starts from the same weights. Stages are parallelized like a whole model.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    get_schedule_class,
)

from loom.config import JobConfig, ParallelConfig
from loom.config.pipeline import (
    SCHEDULES,
    balanced_split,
    bubble_fraction,
    choose_microbatches,
    effective_schedule,
    stage_indices,
    stages_per_rank,
)
from loom.losses import Criterion
from loom.models.registry import for_model
from loom.models.spec import ModelParts
from loom.numerics.precision import torch_dtype
from loom.parallel.mesh import ParallelDims
from loom.trainer.step import Accumulated, Batch, StepExecutor

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
    activations are sequence-sharded across tp and in the compute dtype."""
    seq, dim, dtype = cfg.data.seq_len, cfg.model.dim, torch_dtype(cfg.parallel.dtype)
    act = torch.empty(microbatch, seq // tp, dim, dtype=dtype, device="meta",
                      requires_grad=True)  # its gradient goes back to the previous stage
    if has_embedding(part):
        inputs = torch.empty(microbatch, seq, dtype=torch.long, device="meta")
    else:
        inputs = act
    if not has_head(part):
        return inputs, act
    width = dim if hidden else cfg.model.vocab_size
    return inputs, torch.empty(microbatch, seq, width, dtype=dtype, device="meta",
                               requires_grad=True)


class PipelineExecutor(StepExecutor):
    """Each loader batch goes through the schedule as `microbatches` slices; the last stage
    applies the criterion, weighted like the accumulation loop's."""

    def __init__(self, parts: list[nn.Module], criterion: Criterion, cfg: JobConfig,
                 dims: ParallelDims, device: torch.device):
        super().__init__(parts, criterion, dims, device)
        self.cfg, p = cfg, cfg.parallel
        per_rank = stages_per_rank(p)
        n_stages = dims.pp * per_rank
        self.stage_ids = stage_indices(dims.pp_rank, dims.pp, per_rank, p.pp_schedule)
        pp_group = dims.get_mesh("pp").get_group()
        self.norm_group = pp_group  # each stage's gradient norm joins the others
        self.microbatches = choose_microbatches(p, cfg.train.batch_size)
        microbatch = cfg.train.batch_size // self.microbatches
        stages = [PipelineStage(part, i, n_stages, device, *stage_io(
                      part, cfg, dims.tp, microbatch, criterion.hidden), group=pp_group)
                  for part, i in zip(parts, self.stage_ids, strict=True)]
        if criterion.hidden:
            parts[-1].hidden_output = True  # the criterion projects through the head
        self.has_first, self.has_last = 0 in self.stage_ids, n_stages - 1 in self.stage_ids
        self.owns_loss = self.has_last and dims.tp_rank == 0
        self.bubble = bubble_fraction(dims.pp, per_rank, self.microbatches)
        self.schedule_name = effective_schedule(p.pp_schedule, dims.pp, self.microbatches)
        if self.schedule_name != p.pp_schedule:
            logger.warning("--pp-schedule %s with %d micro-batch(es) < pp %d runs as %s "
                           "(the same order); raise --batch-size for 1F1B", p.pp_schedule,
                           self.microbatches, dims.pp, self.schedule_name)
        schedule = get_schedule_class(SCHEDULES[self.schedule_name])
        single = issubclass(schedule, PipelineScheduleSingle)
        self.schedule = schedule(stages[0] if single else stages, self.microbatches,
                                 loss_fn=self.loss, scale_grads=False)
        held: list[dict[int, list[int]] | None] = [None] * dims.pp
        dist.all_gather_object(held, {i: held_layers(part, cfg.model.n_layers) for i, part
                                      in zip(self.stage_ids, parts, strict=True)},
                               group=pp_group)
        self.layers_by_stage = dict(sorted((i, layers) for stage in held
                                           for i, layers in stage.items()))
        self.scale: torch.Tensor | float = 1.0
        self.sums: list[torch.Tensor] = []
        logger.info("pipeline: pp %d, %s, %d stage(s) per rank, %d micro-batches per batch "
                    "of %d (bubble %.0f%% in theory; --pp-microbatches)", dims.pp,
                    self.schedule_name, per_rank, self.microbatches, cfg.train.batch_size,
                    100 * self.bubble)

    def layout(self) -> dict[str, object]:
        p = self.cfg.parallel
        per_rank = stages_per_rank(p)
        return {"pipeline": {
            "schedule": self.schedule_name, "microbatches": self.microbatches,
            "stages_per_rank": per_rank, "bubble_theory": self.bubble,
            "layers_by_stage": self.layers_by_stage,
            "stages_by_pp_rank": [stage_indices(r, self.dims.pp, per_rank, p.pp_schedule)
                                  for r in range(self.dims.pp)]}}

    def loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The schedule's loss_fn on the last stage: the weighted loss sum (the sum kept)."""
        loss_sum, _ = self.criterion(output, labels)
        self.sums.append(loss_sum.detach())
        return loss_sum * self.scale

    def run(self, batch: Batch, schedule: Callable[..., object]) -> torch.Tensor:
        """One loader batch through `schedule` (step or eval); the owned loss sum."""
        inputs, labels = self.to_device(batch)
        self.sums = []
        documents = self.documents(inputs)  # a keyword: the schedule hands it to every stage
        schedule(*([inputs] if self.has_first else []),
                 target=labels if self.has_last else None, return_outputs=False,
                 **({} if documents is None else {"documents": documents}))
        return self.owned(torch.stack(self.sums).sum() if self.sums
                          else torch.zeros((), device=self.device))

    def forward_backward(self, micro_batches: list[Batch],
                         forward_done: Callable[[], None]) -> Accumulated:
        """Forward and backward interleave inside the schedule: `forward_done` is not
        called, so the step's time counts as backward."""
        total = self.count_valid(micro_batches)
        self.scale = self.dims.loss_size / total
        loss_sum = sum(self.run(batch, self.schedule.step) for batch in micro_batches)
        return Accumulated(loss_sum, total)

    @torch.no_grad()
    def loss_sum(self, batch: Batch) -> torch.Tensor:
        self.scale = 1.0
        return self.run(batch, self.schedule.eval)
