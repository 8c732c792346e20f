"""The step executor: forward and backward of one optimizer step's micro-batches over the
model parts, and a batch's loss without gradients (evaluation).

The loss is a sum over valid tokens. Each backward weighs its sum by (loss ranks / the
step's valid tokens), so FSDP's average over the loss mesh makes every gradient the mean over
the global batch's valid tokens, whatever the layout. Only one rank per loss-mesh coordinate
owns the sum (tp ranks hold copies, pipeline stages without the head hold none): summing the
owned shares over every rank gives the step's loss once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from loom.checkpoint.checkpointer import LoopState
from loom.losses import IGNORE_INDEX, Criterion
from loom.models.context import ForwardContext
from loom.parallel.context import gather_sequence, shard_sequence
from loom.parallel.grad_sync import set_gradient_sync
from loom.parallel.mesh import ParallelDims
from loom.runtime.distributed import summed
from loom.runtime.host_hygiene import to_device

Batch = dict[str, torch.Tensor]
MicroLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor, "ForwardContext | None"],
                     torch.Tensor]
"""(model, inputs, targets, context) -> one micro-batch's loss sums (`Criterion.sums`)."""


def document_ids(inputs: torch.Tensor, eot_id: int) -> torch.Tensor:
    """(B, T) input ids -> (B, T) index of the packed document each token belongs to: an
    end-of-text token closes its document, the token after it opens the next (--doc-mask).
    Derived from the ids themselves, so every loader, layout and pipeline stage agrees."""
    ends = (inputs == eot_id).long()
    return ends.cumsum(dim=1) - ends


def forward_loss(criterion: Criterion, model: nn.Module, inputs: torch.Tensor,
                 targets: torch.Tensor, ctx: ForwardContext | None) -> torch.Tensor:
    """One micro-batch's forward and criterion: what a single-device compile takes whole."""
    return criterion.model_sums(model, inputs, targets, ctx)


@dataclass
class StepResult:
    """One optimizer step: loss (mean over the global batch's valid tokens), pre-clip
    gradient norm and valid tokens stay on the device, and so do the step hooks' metrics
    (MoE's) until the logging step reads them with the row."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    valid_tokens: torch.Tensor
    hook_metrics: dict[str, torch.Tensor | float] = field(default_factory=dict)
    applied: torch.Tensor | None = None
    """1.0 where the optimizer applied the update, 0.0 where a non-finite step was skipped
    (on the device: read with the metrics)."""
    trained: float = 1.0
    """The share of the global batch the step trained: 1.0, less where only some replica
    groups took part (--ft-replica-groups), 0.0 where torchft discarded the step."""


@dataclass
class Accumulated:
    """Forward and backward done: this rank's owned share of the loss sum, and the step's
    valid-token count summed over the loss mesh."""

    loss_sum: torch.Tensor
    valid: torch.Tensor
    metrics: dict[str, torch.Tensor | float] = field(default_factory=dict)
    """The extra depths' loss (`Depths.metric`) over the step's valid tokens, on the
    device; the replica groups' columns (host values)."""
    trained: float = 1.0
    """The share of the global batch this step trains (`StepResult.trained`); 0.0: the
    update must not be applied."""


class StepExecutor(ABC):
    """Forward and backward over the model parts; subclasses decide how micro-batches flow."""

    owns_loss: bool
    norm_group: dist.ProcessGroup | None = None
    """Where gradient-norm squares are summed besides each parameter's own mesh."""

    eot_id: int | None = None
    """--doc-mask: the end-of-text id that separates packed documents (None: no mask)."""

    forwards_per_batch: int = 1
    """Forwards each loader batch takes (a pipeline's micro-batches); times the
    accumulation steps, the forwards of one optimizer step (`weigh_own_losses`)."""

    flex_mask: bool = False
    """Ask for --doc-mask's FlexAttention block mask (`ForwardContext.flex_mask`): compiled
    runs, where flex has kernels."""

    votes: bool = False
    """Whether the update is decided on the host after the step (the replica groups'
    commit vote): then never masked on the device."""

    marks_steps: bool = False
    """Compiled in reduce-overhead mode (--cuda-graphs): each step begins with
    `torch.compiler.cudagraph_mark_step_begin()`, telling CUDA graph trees that the last
    step's graph outputs are no longer read, so its recorded graphs replay instead of
    being re-recorded or refused for a live output."""

    def __init__(self, parts: list[nn.Module], criterion: Criterion, dims: ParallelDims,
                 device: torch.device):
        self.parts, self.criterion, self.dims, self.device = parts, criterion, dims, device
        self.loss_group = dims.get_mesh("loss").get_group()

    def layout(self) -> dict[str, object]:
        """How the step is executed, for config.json (the pipeline's stages and bubble)."""
        return {}

    def summary(self) -> dict[str, object]:
        """What summary.json adds about the step (the replica groups' step counts)."""
        return {}

    def after_update(self) -> dict[str, float]:
        """Metrics of what the executor did inside the optimizer's step (--ft diloco's sync
        runs in the inner optimizer's step hook), read after it; none for a plain step."""
        return {}

    def own_state(self) -> dict[str, torch.Tensor]:
        """Tensors the step itself carries across steps, which a checkpoint keeps beside the
        model and optimizer (--ft diloco's outer optimizer and last sync's weights), by
        name; none for a plain step."""
        return {}

    def resumed_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Tensors shaped as `own_state()`'s for a checkpoint to load into; the executor
        applies them when it starts (`share_state`)."""
        return {}

    def share_state(self, trainer: object) -> LoopState:
        """Where the loop starts: the trainer's own position (a replica group restarted
        under --ft-replica-groups takes a healthy group's)."""
        return trainer.loop  # type: ignore[attr-defined]

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]

    def count_valid(self, micro_batches: list[Batch]) -> torch.Tensor:
        """The step's valid tokens over the loss mesh: int64, exact at any batch size."""
        valid = torch.stack([(b["labels"] != IGNORE_INDEX).sum() for b in micro_batches])
        return summed(valid.sum().to(self.device), self.loss_group)

    def owned(self, loss_sum: torch.Tensor) -> torch.Tensor:
        return loss_sum if self.owns_loss else torch.zeros_like(loss_sum)

    def to_device(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return to_device(batch["input"], self.device), to_device(batch["labels"], self.device)

    def targets(self, labels: torch.Tensor, documents: torch.Tensor | None,
                depths: bool) -> torch.Tensor:
        """What the criterion scores (`Criterion.targets`): with the extra depths' labels
        where `depths`. Under context parallel the depths' labels come from the whole
        sequences (a label d ahead may be another rank's), then this rank's shard of them
        is taken, so each rank scores its own positions."""
        if not (depths and self.criterion.depths.count):
            return labels
        if not self.dims.cp_enabled:
            return self.criterion.targets(labels, True, documents)
        mesh = self.dims.get_mesh("cp")
        whole = self.criterion.targets(gather_sequence(labels, mesh), True, documents)
        return shard_sequence(whole, mesh.size(), mesh.get_local_rank(), dim=2)

    def depth_metrics(self, depth_sum: torch.Tensor, total: torch.Tensor
                      ) -> dict[str, torch.Tensor]:
        """The depths' metric: this rank's owned share of their loss sum, summed over every
        rank, over the step's valid tokens (as the step's loss is formed)."""
        depths = self.criterion.depths
        if not depths.count:
            return {}
        return {depths.metric: summed(self.owned(depth_sum).float()) / total}

    def context(self, documents: torch.Tensor | None) -> ForwardContext | None:
        return None if documents is None else ForwardContext(documents=documents,
                                                              flex_mask=self.flex_mask)

    def documents(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The batch's document indices under --doc-mask, else None: of the whole sequences
        under context parallel (`inputs` are this rank's shards; a document may span them),
        which the model's cp hook turns into this shard's positions and mask."""
        if self.eot_id is None:
            return None
        if self.dims.cp_enabled:
            inputs = gather_sequence(inputs, self.dims.get_mesh("cp"))
        return document_ids(inputs, self.eot_id)

    @abstractmethod
    def forward_backward(self, micro_batches: list[Batch],
                         forward_done: Callable[[], None]) -> Accumulated:
        """Forward and backward of one optimizer step's micro-batches."""

    @abstractmethod
    def loss_sum(self, batch: Batch) -> torch.Tensor:
        """This rank's owned share of the batch's loss sum, without gradients."""


class AccumulationExecutor(StepExecutor):
    """One model part: each micro-batch's forward and backward in turn, gradients reduced
    across dp after the last (`defer_reduction`: each weight's full-size gradient is held
    until then) or after each."""

    def __init__(self, parts: list[nn.Module], criterion: Criterion, dims: ParallelDims,
                 device: torch.device, defer_reduction: bool = True):
        super().__init__(parts, criterion, dims, device)
        self.owns_loss = dims.tp_rank == 0
        self.defer_reduction = defer_reduction
        self.micro_loss: MicroLoss = partial(forward_loss, criterion)
        """Replaced by its compiled form where model and loss compile as one graph."""

    def forward_backward(self, micro_batches: list[Batch],
                         forward_done: Callable[[], None]) -> Accumulated:
        if self.marks_steps:  # the last step's graph outputs are dead: replay may reuse them
            torch.compiler.cudagraph_mark_step_begin()
        total = self.count_valid(micro_batches)
        scale = self.dims.loss_size / total
        model = self.parts[0]
        sums = torch.zeros(3, device=self.device)
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            if len(micro_batches) > 1 and self.defer_reduction:
                set_gradient_sync(model, last)
            inputs, labels = self.to_device(batch)
            documents = self.documents(inputs)
            micro = self.micro_loss(model, inputs, self.targets(labels, documents, True),
                                    self.context(documents))
            if last:
                forward_done()
            (self.criterion.objective(micro) * scale).backward()
            sums += micro.detach()
        return Accumulated(self.owned(sums[1]), total, self.depth_metrics(sums[2], total))

    @torch.no_grad()
    def loss_sum(self, batch: Batch) -> torch.Tensor:
        if self.marks_steps:  # each evaluation batch is a new replay, as each step is
            torch.compiler.cudagraph_mark_step_begin()
        inputs, labels = self.to_device(batch)
        documents = self.documents(inputs)
        return self.owned(self.micro_loss(self.parts[0], inputs, labels,
                                          self.context(documents))[1])


def parts_module(parts: list[nn.Module]) -> nn.Module:
    """One module holding every parameter of this rank's parts (for the optimizer, the
    checkpoint and the metrics): the part itself when there is one."""
    return parts[0] if len(parts) == 1 else nn.ModuleList(parts)


def ahead_on_device(steps: Iterator[tuple[int, int, list[Batch]]], device: torch.device
                    ) -> Iterator[tuple[int, int, list[Batch]]]:
    """The steps' micro-batches copied to `device` one step ahead: step k+1's copy is
    queued (non-blocking) before step k is handed out, so it runs behind step k's work on
    the device's stream and step k+1 finds its data there without a host wait."""
    queued = None
    for epoch, bidx, micro in steps:
        moved = (epoch, bidx, [{k: to_device(v, device) for k, v in b.items()} for b in micro])
        if queued is not None:
            yield queued
        queued = moved
    if queued is not None:
        yield queued
