"""Which step executor a run uses. Apart from `loom.trainer.step` (the executor protocol and the
plain accumulation loop), which `loom.parallel.pipeline` builds on: choosing between the
two needs both, so it lives above them."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from loom.config import ConfigError, JobConfig
from loom.losses import build_criterion
from loom.models.registry import named_part
from loom.parallel.compile import compile_kwargs
from loom.parallel.mesh import ParallelDims
from loom.parallel.single import runs_plain
from loom.trainer.pipeline import PipelineExecutor
from loom.trainer.step import AccumulationExecutor, StepExecutor


def build_executor(parts: list[nn.Module], cfg: JobConfig, dims: ParallelDims,
                   device: torch.device, eot_id: int | None = None) -> StepExecutor:
    """The pipelined executor under --pp > 1, else the accumulation loop; the criterion
    projects through the head of the last part (held by the pipeline's last stage).
    `eot_id`: the data's end-of-text id, which --doc-mask splits documents at."""
    p = cfg.parallel
    head = named_part(parts[-1], "output")
    criterion = build_criterion(cfg.loss, head, dims.tp, compile_kwargs(
        p.compile_mode, p.compile_backend) if head_in_graph(cfg, dims, head) else None)
    if dims.pp_enabled:
        executor: StepExecutor = PipelineExecutor(parts, criterion, cfg, dims, device)
    else:
        executor = AccumulationExecutor(parts, criterion, dims, device,
                                        defer_reduction=cfg.train.accum_reduce == "step")
    if cfg.data.doc_mask:
        check_takes_documents(parts)
    executor.eot_id = eot_id if cfg.data.doc_mask else None
    if isinstance(executor, AccumulationExecutor) and loss_in_graph(cfg, dims):
        executor.micro_loss = torch.compile(executor.micro_loss,
                                            **compile_kwargs(p.compile_mode, p.compile_backend))
    return executor


def loss_in_graph(cfg: JobConfig, dims: ParallelDims) -> bool:
    """Whether forward and loss compile as one graph: --compile on the single-device path
    (no wrapper hook splits the model) and a loss that traces whole. The already compiled
    model is inlined into that graph."""
    return cfg.parallel.compile and runs_plain(dims, cfg.parallel) and loss_traces_whole(cfg)


def head_in_graph(cfg: JobConfig, dims: ParallelDims, head: nn.Module | None) -> bool:
    """Whether the output head and the loss compile as one graph of their own, the model
    returning its final hidden states: --compile under FSDP2, whose hooks keep the model's
    forward from being one graph with its loss, with the whole model on this rank (no
    pipeline), whole logits (no tp, whose head returns a DTensor), and a loss that traces
    whole, on a head that takes a loss into its call. SimpleFSDP compiles the whole
    model, the head included, already."""
    p = cfg.parallel
    return (p.compile and p.data_parallel == "fsdp2" and not runs_plain(dims, p)
            and not dims.pp_enabled and dims.tp == 1 and takes_apply(head)
            and loss_traces_whole(cfg))


def takes_apply(head: nn.Module | None) -> bool:
    """Whether the family's head can run a loss on its weight inside its own call
    (`head(h, apply=f)`, llama's `OutputHead`): other heads keep the loss outside."""
    return head is not None and "apply" in inspect.signature(head.forward).parameters


def loss_traces_whole(cfg: JobConfig) -> bool:
    """loom's own model (its final hidden states and head), and a loss over logits that
    traces whole: the fused and chunked losses are autograd Functions with Python loops;
    the logits probe reads values."""
    return (not cfg.model.runs_transformers and not cfg.loss.debug_logits
            and cfg.loss.loss_impl in ("eager", "compiled"))


def check_takes_documents(parts: list[nn.Module]) -> None:
    """--doc-mask hands every model part the batch's `documents`: a family whose model has
    no such argument (no document mask) is refused in one line before the first step, not
    a TypeError inside it."""
    for part in parts:
        params = inspect.signature(part.forward).parameters.values()
        if not any(p.name == "documents" or p.kind is p.VAR_KEYWORD for p in params):
            raise ConfigError(f"--doc-mask: the {type(part).__name__} model takes no document "
                              "ids (its family has no document mask); drop --doc-mask")
