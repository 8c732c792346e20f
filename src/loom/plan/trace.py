"""One training step of the real parallelized model, traced under fake tensors.

A fake process group of N ranks lets this one process build rank 0's share of any mesh;
FakeTensorMode gives every tensor a shape and no storage, so nothing is allocated and
nothing is computed. torch's FSDPMemTracker follows the step and records the peak of
live tensor bytes by category (parameters, gradients, optimizer state, activations,
temporaries, all-gather and reduce-scatter buffers). Rank 0 is the worst rank: FSDP2
pads every shard to the size of the first one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.pipelining import PipelineStage
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from loom.config import ConfigError, JobConfig
from loom.config.resolved import settled
from loom.lora import converter as _lora  # noqa: F401  (registers the --lora-rank converter)
from loom.losses import Criterion, build_criterion
from loom.losses.cross_entropy import localise
from loom.models.context import ForwardContext
from loom.models.registry import for_config, output_of, routing_of
from loom.models.resolve import plain_model
from loom.models.spec import ModelParts
from loom.numerics import float8 as _float8  # noqa: F401  (registers the --float8 converter)
from loom.numerics.precision import torch_dtype
from loom.parallel.grad_sync import set_gradient_sync
from loom.parallel.mesh import ParallelDims
from loom.parallel.parallelize import parallelize
from loom.parallel.pipeline_stages import stage_module
from loom.parallel.single import step_autocast
from loom.plan.compiled import compiled_loss_memory
from loom.protocols.extensions import convert_model
from loom.runtime.distributed import caller_excepthook
from loom.runtime.scope import logger_levels
from loom.trainer.executor import depths_of, loss_in_graph
from loom.trainer.optim import build_optimizer, clip_grad_norm
from loom.trainer.step import document_ids

Breakdown = dict[str, int]
"""Bytes live at the peak, by FSDPMemTracker category ('Total' excluded)."""

PEAK = "peak"
"""The key of the whole step's peak among the phases `trace_step` returns."""
MICROBATCH = "microbatch"
"""The key of the bytes one micro-batch keeps alive from its forward to its backward (its
activations, and the loss's saved tensors on the last stage): not a phase."""
HELD = "held"
"""The key of the bytes a step holds between two micro-batches beyond those alive before it
(gradients kept unreduced, parameters kept gathered, until the last one): not a phase."""
FIRST = "|first"
"""Appended to the name of a phase of the first of two micro-batches."""


def first_micro_batch(name: str) -> bool:
    return name.endswith(FIRST)


@dataclass(frozen=True)
class Stage:
    """A pipeline stage to trace: whether it holds the embedding and the head, the samples
    of one pipeline micro-batch and how many micro-batches a step has."""

    first: bool
    last: bool
    microbatch: int
    microbatches: int


@contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake process group of `world_size` ranks for this process (rank 0)."""
    if dist.is_initialized():
        raise RuntimeError("loom plan needs a process without a process group")
    with caller_excepthook():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        try:
            yield
        finally:
            dist.destroy_process_group()


@contextmanager
def quiet() -> Iterator[None]:
    """No warnings from a traced build: they speak of the reduced depth or stage (a stage
    of the head alone has no blocks to checkpoint), not of the user's flags."""
    with logger_levels({"loom": logging.ERROR}):
        yield


class WorstCaseNonzero(TorchDispatchMode):
    """Fake tensors cannot know how many elements are nonzero; answer "all of them" (the
    index tensor's largest size), so the trace stays an upper bound. loss-parallel's
    backward selects the rows whose target is on this vocabulary shard this way."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.nonzero.default:
            (x,) = args
            return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        return func(*args, **(kwargs or {}))


def layer_settings(cfg: JobConfig, n_layers: int) -> dict[str, int]:
    """The model settings of `cfg`'s model cut to `n_layers` blocks (the same block shapes),
    for `settled`."""
    routed = routing_of(cfg.model)
    return {"n_layers": n_layers,
            **({"n_dense_layers": min(routed.dense_layers, n_layers)} if routed else {})}


TRACEABLE = {"compile": False, "single_device": "fsdp2", "data_parallel": "fsdp2"}
"""The settings a traced step runs under (`settled`). Dynamo cannot compile under the
tracker's dispatch modes, so the trace runs eager blocks (`loom.plan.memory` applies what
compile saves) and `traced_criterion`. The tracker follows FSDP2 units, so a one-process
plan traces FSDP2 at one rank: the same parameters, gradients and optimizer state as the
unwrapped model training runs, plus FSDP2's unshard buffers (the plan errs high by those).
SimpleFSDP is traced as FSDP2 for the same reason: the same parameter, gradient and
optimizer shards; its own gathers (per parameter on access, or compile's buckets) are
taken to hold what FSDP2's per-block unshard holds."""


def traced_criterion(cfg: JobConfig, model: torch.nn.Module, tp: int,
                     in_graph: bool = False) -> Criterion:
    """`build_criterion`, with the compiled loss's memory in place of torch.compile; also
    where the loss compiles into the model's graph (`in_graph`: --compile at one process,
    `loss_in_graph`), which fuses the eager cross-entropy as --loss-impl compiled does."""
    head, depths = output_of(model), depths_of(model)
    if cfg.loss.loss_impl == "compiled" or in_graph:
        return Criterion(lambda logits, labels: compiled_loss_memory(localise(logits), labels,
                                                                     donated=in_graph),
                         depths=depths)
    return build_criterion(cfg.loss, head, tp, depths=depths)


def _categories(snapshot: dict) -> Breakdown:
    return {str(getattr(kind, "value", kind)): nbytes for kind, nbytes in snapshot.items()
            if kind != "Total"}


def part_names(cfg: JobConfig) -> ModelParts:
    """The names of the family's parts, which the trace's phases are named by."""
    spec = for_config(cfg.model)
    if spec.parts is None:
        raise ConfigError(f"loom plan: the {spec.name} family names no parts to trace")
    return spec.parts


def _phase_name(fqn: str, state: object, n_layers: int, blocks: str) -> str:
    """'<module>|<state>', the last block (in the family's container `blocks`) named 'last'
    so traces of any depth share it."""
    parts = fqn.split(".")
    if blocks in parts[:-1] and parts[parts.index(blocks) + 1] == str(n_layers - 1):
        parts[parts.index(blocks) + 1] = "last"
    return f"{'.'.join(parts)}|{getattr(state, 'value', state)}"


def module_phases(tracker: FSDPMemTracker, n_layers: int, blocks: str
                  ) -> dict[str, Breakdown]:
    """Each FSDP unit's forward and backward peak snapshot."""
    phases = {}
    for stats in tracker.memory_tracking.values():
        for state, snaps in stats.snapshots.items():
            if "Peak" in str(getattr(state, "value", state)) and snaps and snaps[-1]:
                (snap,) = snaps[-1].values()
                phases[_phase_name(stats.mod_fqn, state, n_layers, blocks)] = \
                    _categories(snap)
    return phases


def trace_step(cfg: JobConfig, world_size: int,
               stage: Stage | None = None) -> dict[str, Breakdown]:
    """Live bytes of rank 0 in the second training step of `cfg` (a resolved config:
    effective --loss-impl) at its peak (`PEAK`), at each FSDP unit's forward and backward
    peak, one micro-batch's forward-to-backward bytes (`MICROBATCH`) and what a first
    micro-batch leaves held for the next (`HELD`, empty with one); needs
    `fake_world(world_size)` around it. With `stage`: one or two micro-batches through that
    pipeline stage of `cfg`'s blocks (`_stage_step`; its input and output gradient made
    before the trace, as the pipeline's receive buffers are).

    The optimizer step runs outside the tracker: under fake tensors the fused AdamW kernel
    reports out-of-place copies of every state that the real in-place kernel never makes
    (measured; the real step's peak is in backward, see benchmarks/plan_accuracy.py)."""
    in_graph = loss_in_graph(cfg, ParallelDims.from_config(cfg.parallel, world_size))
    cfg = settled(cfg, **TRACEABLE)
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = plain_model(cfg)
    if stage is not None:
        n = cfg.model.n_layers
        model = stage_module(model, range(0 if stage.first else 1, n + 2 if stage.last else n + 1))
    convert_model(model, cfg, traced_only=True)  # LoRA's adapters, float8's torchao linears
    with quiet():
        parallelize(model, dims, cfg.parallel,
                    loss_parallel=cfg.loss.loss_impl == "loss-parallel", backend="gloo")
    with FakeTensorMode(allow_non_fake_inputs=True), WorstCaseNonzero():
        model.to_empty(device="cpu")
        model.init_buffers(torch.device("cpu"))
        optimizer = build_optimizer(model, cfg.optim)
        step = (_stage_step(model, cfg, dims, stage) if stage
                else _model_step(model, cfg, dims, in_graph))
        step(lambda: None, lambda: None)
        optimizer.step()  # creates the optimizer state: the next step is the steady state
        optimizer.zero_grad(set_to_none=True)
        tracker = FSDPMemTracker(model, optimizer)
        n_layers, blocks = cfg.model.n_layers, part_names(cfg).blocks
        after_forward: Breakdown = {}

        def mark() -> None:
            (now,) = tracker.get_tracker_snapshot().values()
            after_forward.update(_categories(now))

        first: dict[str, Breakdown] = {}
        held: Breakdown = {}

        def between() -> None:  # the tracker follows one call of each unit: keep, restart
            phases = module_phases(tracker, n_layers, blocks)
            first.update({k + FIRST: b for k, b in phases.items()})
            (peak_so_far,) = tracker.get_tracker_snapshot("peak").values()
            first[PEAK + FIRST] = _categories(peak_so_far)
            (now,) = tracker.get_tracker_snapshot().values()
            held.update({k: n - before.get(k, 0) for k, n in _categories(now).items()})
            tracker.reset_mod_stats()
        with tracker:
            (before,) = tracker.get_tracker_snapshot().values()
            before = _categories(before)
            step(mark, between)
        (peak,) = tracker.get_tracker_snapshot("peak").values()
        kept = {k: after_forward.get(k, 0) - before.get(k, 0) for k in ("Activation", "Temp")}
        return {PEAK: _categories(peak), MICROBATCH: kept, HELD: held, **first,
                **module_phases(tracker, n_layers, blocks)}


Step = Callable[[Callable[[], None], Callable[[], None]], None]
"""Forward, the first callback (forward and loss done), backward, clipping; the second
callback runs between two micro-batches of a pipeline stage."""


def traced_documents(tokens: torch.Tensor, cfg: JobConfig) -> torch.Tensor | None:
    """Under --doc-mask, document ids of the whole sequences the traced tokens belong to
    (a cp rank's tokens are a shard of them), so the mask each forward builds is counted
    (its size, not its pattern, is what memory depends on)."""
    if not cfg.data.doc_mask:
        return None
    return document_ids(tokens.new_zeros(tokens.shape[0], cfg.data.seq_len), 0)


def _model_step(model: torch.nn.Module, cfg: JobConfig, dims: ParallelDims,
                in_graph: bool = False) -> Step:
    """`Trainer.train_step` up to the optimizer step, for one micro-batch of this rank's
    tokens (a 1/cp share of each sequence under context parallel); under --grad-accum-steps
    for two, the second beside the first's gradients: unreduced (--accum-reduce step) or
    reduced into the sharded ones, as the accumulation loop leaves them. `in_graph`: the
    loss compiles with the model (`traced_criterion`)."""
    criterion = traced_criterion(cfg, model, dims.tp, in_graph)
    tokens = torch.zeros(cfg.train.batch_size, cfg.data.seq_len // dims.cp, dtype=torch.long)
    documents = traced_documents(tokens, cfg)
    ctx = None if documents is None else ForwardContext(documents=documents)
    targets = criterion.targets(tokens, True, documents)

    micro_batches = 2 if cfg.train.grad_accum_steps > 1 else 1
    autocast = step_autocast(dims, cfg.parallel, "cpu")
    deferred = cfg.train.accum_reduce == "step"

    def step(forward_done: Callable[[], None], between: Callable[[], None]) -> None:
        for i in range(micro_batches):
            if i:
                between()
            if micro_batches > 1 and deferred:
                set_gradient_sync(model, i == micro_batches - 1)
            with autocast():  # the step's own (bf16 at one process)
                sums = criterion.model_sums(model, tokens, targets, ctx)
            loss = criterion.objective(sums) / tokens.numel()
            if i == 0:
                forward_done()
            loss.backward()
        clip_grad_norm(model.parameters(), cfg.optim.max_grad_norm)
    return step


def _stage_step(model: torch.nn.Module, cfg: JobConfig, dims: ParallelDims,
                stage: Stage) -> Step:
    """Micro-batches through a pipeline stage, as torch's schedule runs them: the first
    stage takes tokens, the others the previous stage's (sequence-sharded) hidden states;
    the last applies the criterion, the others take their output's gradient. Backward
    keeps the parameters gathered and the gradients unsharded (torch defers FSDP's
    reduction to after the last micro-batch, `perform_reduce_grad`), so a second
    micro-batch, when there is one, runs beside the first one's gradients."""
    criterion = traced_criterion(cfg, model, dims.tp)
    mb, seq, dim = stage.microbatch, cfg.data.seq_len // dims.cp, cfg.model.dim  # cp: a shard
    dtype = torch_dtype(cfg.parallel.dtype)
    tokens = torch.zeros(mb, seq, dtype=torch.long)
    documents = traced_documents(tokens, cfg)
    depths = criterion.depths.count
    ctx = ForwardContext(documents=documents, token_ids=tokens if depths else None,
                         hidden=criterion.hidden, depths=depths > 0)
    targets = criterion.targets(tokens, True, documents)
    rows = mb * (1 + depths)  # the depths' rows travel below the hidden states
    hidden = torch.zeros(rows, seq // dims.tp, dim, dtype=dtype, requires_grad=True)
    grad = torch.zeros(rows, seq // dims.tp, dim, dtype=dtype)
    n_stages = max(3, dist.get_world_size())  # over the default group: it sends nothing
    index = 0 if stage.first else n_stages - 1 if stage.last else 1
    pipeline_stage = PipelineStage(model, index, n_stages, torch.device("cpu"))

    def step(forward_done: Callable[[], None], between: Callable[[], None]) -> None:
        model.set_is_last_backward(False)
        model.set_reshard_after_backward(False)
        model.set_requires_gradient_sync(False)
        for i in range(min(2, stage.microbatches)):  # the second sees the first's gradients
            if i:
                between()
            out = model(tokens if stage.first else hidden, ctx=ctx)  # kept to backward, as
            loss = criterion.objective(criterion.sums(out, targets)) if stage.last \
                else None  # the schedule does
            if i == 0:
                forward_done()
            if loss is None:
                out.backward(grad)
            else:
                loss.backward()
        pipeline_stage.perform_reduce_grad(1)
        clip_grad_norm(model.parameters(), cfg.optim.max_grad_norm)
    return step
