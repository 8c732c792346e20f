"""Which step executor a run uses. Apart from `loom.trainer.step` (the executor protocol and the
plain accumulation loop), which `loom.parallel.pipeline_stages` builds on: choosing between the
two needs both, so it lives above them."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from loom.config import ConfigError, JobConfig
from loom.losses import build_criterion
from loom.models.registry import named_part, spec_of
from loom.models.spec import NO_DEPTHS, Depths
from loom.parallel.compile import compile_kwargs
from loom.parallel.mesh import ParallelDims
from loom.parallel.single import runs_plain, step_autocast, within
from loom.trainer.diloco import DiLoCoExecutor
from loom.trainer.pipeline_executor import PipelineExecutor
from loom.trainer.replica_groups import ReplicaGroupExecutor
from loom.trainer.step import AccumulationExecutor, StepExecutor


def build_executor(parts: list[nn.Module], cfg: JobConfig, dims: ParallelDims,
                   device: torch.device, eot_id: int | None = None) -> StepExecutor:
    """The pipelined executor under --pp > 1, else the accumulation loop; the criterion
    projects through the head of the last part (held by the pipeline's last stage).
    `eot_id`: the data's end-of-text id, which --doc-mask splits documents at."""
    criterion = build_criterion(cfg.loss, named_part(parts[-1], "output"), dims.tp,
                                in_forward=head_in_forward(cfg, dims, parts[-1]),
                                depths=depths_of(parts[-1]))
    if dims.pp_enabled:
        executor: StepExecutor = PipelineExecutor(parts, criterion, cfg, dims, device)
    else:
        executor = AccumulationExecutor(parts, criterion, dims, device,
                                        defer_reduction=cfg.train.accum_reduce == "step")
    weigh_own_losses(parts, cfg.train.grad_accum_steps * executor.forwards_per_batch)
    if cfg.data.doc_mask:
        check_takes_documents(parts)
    executor.eot_id = eot_id if cfg.data.doc_mask else None
    executor.flex_mask = cfg.parallel.compile  # flex pays compiled only
    executor.marks_steps = cfg.parallel.compile and cfg.parallel.compile_mode == "reduce-overhead"
    if isinstance(executor, AccumulationExecutor):  # bf16 at one process: the step's autocast
        executor.micro_loss = within(step_autocast(dims, cfg.parallel, device.type),
                                     executor.micro_loss)
    if isinstance(executor, AccumulationExecutor) and loss_in_graph(cfg, dims):
        p = cfg.parallel
        executor.micro_loss = torch.compile(executor.micro_loss,
                                            **compile_kwargs(p.compile_mode, p.compile_backend))
    return maybe_replica_groups(executor, cfg, dims)


def maybe_replica_groups(executor: StepExecutor, cfg: JobConfig, dims: ParallelDims
                         ) -> StepExecutor:
    """`executor`, wrapped under --ft-replica-groups by --ft's algorithm (torchft is imported
    by the wrapper, only then)."""
    if dims.replica_groups == 1:
        return executor
    wrapper = DiLoCoExecutor if cfg.parallel.ft == "diloco" else ReplicaGroupExecutor
    return wrapper(executor, cfg, dims)  # type: ignore[return-value]


def loss_in_graph(cfg: JobConfig, dims: ParallelDims) -> bool:
    """Whether forward and loss compile as one graph: --compile on the single-device path
    (no wrapper hook splits the model), loom's own model, and a loss over logits that traces
    whole (the fused and chunked losses are autograd Functions with Python loops; the logits
    probe reads values). The already compiled model is inlined into that graph."""
    return (cfg.parallel.compile and runs_plain(dims, cfg.parallel)
            and not cfg.model.runs_transformers and not cfg.loss.debug_logits
            and cfg.loss.loss_impl in ("eager", "compiled"))


def head_in_forward(cfg: JobConfig, dims: ParallelDims, model: nn.Module) -> bool:
    """Whether a loss the head computes on its weight (fused-linear) can run inside the
    model's forward (`ctx.head_apply`), where the head's FSDP2 unit (with the final norm)
    completes its forward once, instead of being finished by the root's end of forward
    and gathered again when the head is called afterwards: the whole model on this rank (no
    pipeline), whole sequences and logits (no cp, no tp, whose plans wrap the model's
    output), a forward that is not one compiled graph (SimpleFSDP's, where the fused
    loss's Python loop would not trace), and a family whose forward takes it. Elsewhere
    the head is called on the returned hidden states."""
    p = cfg.parallel
    whole_graph = p.compile and p.data_parallel == "simple-fsdp"
    return (not dims.pp_enabled and dims.tp == 1 and not dims.cp_enabled and not whole_graph
            and named_part(model, "output") is not None
            and takes_context(model))


def takes_context(model: nn.Module) -> bool:
    """Whether the model's forward takes a `ctx` (`loom.models.context`): loom's families
    do, a transformers model does not."""
    return "ctx" in inspect.signature(model.forward).parameters


def depths_of(model: nn.Module) -> Depths:
    """The model's extra prediction depths, which its family's spec declares (none for a
    model no family of loom's builds)."""
    spec = spec_of(model)
    return NO_DEPTHS if spec is None else spec.depths(model)


def weigh_own_losses(parts: list[nn.Module], forwards: int) -> None:
    """Tell a family whose forward adds a loss of its own (MoE's balance loss) how many
    forwards one optimizer step takes (accumulation steps, a pipeline's micro-batches or
    both), through its spec: the main loss is a mean over the step's tokens, so each
    forward's own loss weighs 1 / forwards for the same reason."""
    for part in parts:
        spec = spec_of(part)
        if spec is not None and spec.weigh_own_losses is not None:
            spec.weigh_own_losses(part, forwards)


def check_takes_documents(parts: list[nn.Module]) -> None:
    """--doc-mask hands every model part the batch's `documents` in its `ctx`: a model
    without one (no document mask) is refused in one line before the first step, not a
    TypeError inside it."""
    for part in parts:
        if not takes_context(part):
            raise ConfigError(f"--doc-mask: the {type(part).__name__} model takes no document "
                              "ids (its family has no document mask); drop --doc-mask")
