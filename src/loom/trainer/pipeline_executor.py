"""The pipeline step executor: each loader batch goes to a `torch.distributed.pipelining`
schedule as micro-batches over the stages `loom.parallel.pipeline_stages` cut. It lives with the
other executors, above `parallel/`, so the cut knows nothing of the step."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    get_schedule_class,
)

from loom.config import JobConfig
from loom.config.pipeline_layout import (
    SCHEDULES,
    bubble_fraction,
    choose_microbatches,
    effective_schedule,
    stage_indices,
    stages_per_rank,
)
from loom.losses import Criterion
from loom.models.context import ForwardContext
from loom.parallel.mesh import ParallelDims
from loom.parallel.pipeline_stages import held_layers, stage_io
from loom.trainer.step import Accumulated, Batch, StepExecutor

logger = logging.getLogger("loom")


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
        self.forwards_per_batch = self.microbatches
        microbatch = cfg.train.batch_size // self.microbatches
        stages = [PipelineStage(part, i, n_stages, device, *stage_io(
                      part, cfg, dims.tp, microbatch, criterion.hidden), group=pp_group)
                  for part, i in zip(parts, self.stage_ids, strict=True)]
        self.depths = criterion.depths.count > 0  # every stage packs and is handed ids
        for part in parts:  # the schedule's keywords -> the stage's declared context
            part.register_forward_pre_hook(
                partial(stage_context, criterion.hidden, self.depths, cfg.parallel.compile),
                prepend=True, with_kwargs=True)
        self.has_first, self.has_last = 0 in self.stage_ids, n_stages - 1 in self.stage_ids
        self.owns_loss = self.has_last and dims.tp_rank == 0
        self.bubble = bubble_fraction(dims.pp, per_rank, self.microbatches, p.pp_schedule)
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

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss_fn on the last stage: the weighted objective (the sums kept)."""
        sums = self.criterion.sums(output, targets)
        self.sums.append(sums.detach())
        return self.criterion.objective(sums) * self.scale

    def run(self, batch: Batch, schedule: Callable[..., object]) -> torch.Tensor:
        """One loader batch through `schedule` (step or eval); the owned loss sums (3,):
        the objective, the main rows' and the extra depths' (`Criterion.sums`). With depths the last
        stage returns their rows in evaluation too (the stages' shapes are fixed); only
        the main sum is the evaluation's loss."""
        inputs, labels = self.to_device(batch)
        self.sums = []
        documents = self.documents(inputs)  # a keyword: the schedule hands it to every stage
        keywords = {} if documents is None else {"documents": documents}
        if self.depths:  # the first stage picks each depth's ids (every rank loads them)
            keywords["token_ids"] = inputs
        targets = self.targets(labels, documents, self.depths)
        schedule(*([inputs] if self.has_first else []),
                 target=targets if self.has_last else None, return_outputs=False, **keywords)
        return self.owned(torch.stack(self.sums).sum(dim=0) if self.sums
                          else torch.zeros(3, device=self.device))

    def forward_backward(self, micro_batches: list[Batch],
                         forward_done: Callable[[], None]) -> Accumulated:
        """Forward and backward interleave inside the schedule: `forward_done` is not
        called, so the step's time counts as backward."""
        total = self.count_valid(micro_batches)
        self.scale = self.dims.loss_size / total
        sums = sum(self.run(batch, self.schedule.step) for batch in micro_batches)
        return Accumulated(sums[1], total, self.depth_metrics(sums[2], total))

    @torch.no_grad()
    def loss_sum(self, batch: Batch) -> torch.Tensor:
        self.scale = 1.0
        return self.run(batch, self.schedule.eval)[1]


def stage_context(hidden: bool, depths: bool, flex_mask: bool, module: nn.Module,
                  args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A stage's forward pre-hook: the tensors the schedule splits into micro-batches and
    hands every stage as keywords (`documents`, `token_ids`) become its `ctx`, with what
    the criterion needs of the last stage (hidden states for fused-linear, the depths)."""
    ctx = ForwardContext(documents=kwargs.pop("documents", None),
                         token_ids=kwargs.pop("token_ids", None), hidden=hidden, depths=depths,
                         flex_mask=flex_mask)
    return args, {**kwargs, "ctx": ctx}
