"""One training step of the real parallelized model, traced under fake tensors.

A fake process group of N ranks lets this one process build rank 0's share of any mesh;
FakeTensorMode gives every tensor a shape and no storage, so nothing is allocated and
nothing is computed. torch's FSDPMemTracker follows the step and records the peak of
live tensor bytes by category (parameters, gradients, optimizer state, activations,
temporaries, all-gather and reduce-scatter buffers). Rank 0 is the worst rank: FSDP2
pads every shard to the size of the first one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from loom.config import JobConfig
from loom.losses import LossFn, build_loss
from loom.mesh import ParallelDims
from loom.modeling import plain_model
from loom.optim import build_optimizer, clip_grad_norm
from loom.parallel.parallelize import parallelize

Breakdown = dict[str, int]
"""Bytes live at the peak, by FSDPMemTracker category ('Total' excluded)."""

PEAK = "peak"
"""The key of the whole step's peak among the phases `trace_step` returns."""


@contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake process group of `world_size` ranks for this process (rank 0)."""
    if dist.is_initialized():
        raise RuntimeError("loom plan needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class WorstCaseNonzero(TorchDispatchMode):
    """Fake tensors cannot know how many elements are nonzero; answer "all of them" (the
    index tensor's largest size), so the trace stays an upper bound. loss-parallel's
    backward selects the rows whose target is on this vocabulary shard this way."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.nonzero.default:
            (x,) = args
            return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        return func(*args, **(kwargs or {}))


def with_layers(cfg: JobConfig, n_layers: int) -> JobConfig:
    """`cfg` with only `n_layers` blocks (the same block shapes)."""
    model = cfg.model
    n_dense = min(model.n_dense_layers, n_layers)
    return replace(cfg, model=replace(model, n_layers=n_layers, n_dense_layers=n_dense))


def traceable(cfg: JobConfig) -> JobConfig:
    """Dynamo cannot compile under the tracker's dispatch modes, so the trace runs eager:
    compiled blocks as eager blocks (`loom.plan.memory` applies --act-mem-budget), and the
    compiled loss as chunked-backward, which like it never holds more than one
    logits-sized buffer for the gradient (their published peaks are equal,
    ../shared/spec/figures.md; checked on CPU by benchmarks/plan_accuracy.py)."""
    loss = "chunked-backward" if cfg.loss.loss_impl == "compiled" else cfg.loss.loss_impl
    return replace(cfg, parallel=replace(cfg.parallel, compile=False),
                   loss=replace(cfg.loss, loss_impl=loss))


def _categories(snapshot: dict) -> Breakdown:
    return {str(getattr(kind, "value", kind)): nbytes for kind, nbytes in snapshot.items()
            if kind != "Total"}


def _phase_name(fqn: str, state: object, n_layers: int) -> str:
    """'<module>|<state>', the last block named 'last' so traces of any depth share it."""
    parts = fqn.split(".")
    if "layers" in parts[:-1] and parts[parts.index("layers") + 1] == str(n_layers - 1):
        parts[parts.index("layers") + 1] = "last"
    return f"{'.'.join(parts)}|{getattr(state, 'value', state)}"


def module_phases(tracker: FSDPMemTracker, n_layers: int) -> dict[str, Breakdown]:
    """Each FSDP unit's forward and backward peak snapshot."""
    phases = {}
    for stats in tracker.memory_tracking.values():
        for state, snaps in stats.snapshots.items():
            if "Peak" in str(getattr(state, "value", state)) and snaps and snaps[-1]:
                (snap,) = snaps[-1].values()
                phases[_phase_name(stats.mod_fqn, state, n_layers)] = _categories(snap)
    return phases


def trace_step(cfg: JobConfig, world_size: int) -> dict[str, Breakdown]:
    """Live bytes of rank 0 in the second training step of `cfg` (a resolved config:
    effective --loss-impl) at its peak (`PEAK`) and at each FSDP unit's forward and
    backward peak; needs `fake_world(world_size)` around it.

    The optimizer step runs outside the tracker: under fake tensors the fused AdamW kernel
    reports out-of-place copies of every state that the real in-place kernel never makes
    (measured; the real step's peak is in backward, see benchmarks/plan_accuracy.py)."""
    cfg = traceable(cfg)
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = plain_model(cfg)
    parallelize(model, dims, cfg.parallel,
                loss_parallel=cfg.loss.loss_impl == "loss-parallel", backend="gloo")
    with FakeTensorMode(allow_non_fake_inputs=True), WorstCaseNonzero():
        model.to_empty(device="cpu")
        model.init_buffers(torch.device("cpu"))
        loss_fn = build_loss(cfg.loss, model, dims.tp)
        optimizer = build_optimizer(model, cfg.optim)
        tokens = torch.zeros(cfg.train.batch_size, cfg.data.seq_len, dtype=torch.long)
        forward_backward(model, loss_fn, tokens, cfg.optim.max_grad_norm)
        optimizer.step()  # creates the optimizer state: the next step is the steady state
        optimizer.zero_grad(set_to_none=True)
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((tokens, tokens))
        with tracker:
            forward_backward(model, loss_fn, tokens, cfg.optim.max_grad_norm)
        (peak,) = tracker.get_tracker_snapshot("peak").values()
        return {PEAK: _categories(peak), **module_phases(tracker, cfg.model.n_layers)}


def forward_backward(model: torch.nn.Module, loss_fn: LossFn, tokens: torch.Tensor,
                     max_grad_norm: float) -> None:
    """`Trainer.train_step` up to the optimizer step, for one micro-batch."""
    loss_fn(model, tokens, tokens).backward()
    clip_grad_norm(model.parameters(), max_grad_norm)
