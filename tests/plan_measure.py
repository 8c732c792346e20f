"""Measured peak tensor memory of a real training step, with the planner's accounting.

The same FSDPMemTracker that follows the fake trace follows `Trainer.train_step` on real
tensors (the whole step, optimizer included), so prediction and measurement count the
same thing: bytes of live tensor storages per category at the step's peak.

Compiled code allocates outside the dispatcher, where the tracker cannot see it. A step of
a run with --compile or the compiled loss is measured at the CPU allocator instead: the
profiler's allocation and free records are summed in time order, and their peak over the
step plus the state alive before it (parameters, gradients, optimizer state, buffers) is
the peak. On eager runs the two ways agree to 0.01 MiB (benchmarks/plan_accuracy.py). The
allocator's records of a free are exact only in a process's first profiled step (a later
one can be credited with a block an earlier one recorded), so such a run must be the only
one of its job.
"""

from __future__ import annotations

import json
import sys

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from loom.config import JobConfig, parse_args
from loom.config.pipeline_layout import stages_per_rank
from loom.observability.profiling import peak_live_bytes
from loom.plan.trace import Breakdown
from loom.runtime.distributed import init_distributed, rank_info, teardown
from loom.runtime.logs import setup_logging
from loom.trainer.reading import batches_from
from loom.trainer.scoped import training
from loom.trainer.trainer import Trainer


def at_allocator(cfg: JobConfig) -> bool:
    """Runs the tracker cannot follow: compiled code, and pipeline ranks holding several
    stages (the tracker follows one FSDP root)."""
    p = cfg.parallel
    return (p.compile or cfg.loss.loss_impl == "compiled"
            or (p.pp > 1 and stages_per_rank(p) > 1))


def measure_step(trainer: Trainer) -> Breakdown:
    """Peak bytes of this rank during its second training step (the first creates the
    optimizer state and compiles)."""
    batches = batches_from(trainer, trainer.loop.samples_seen)
    _, _, micro = next(batches)
    trainer.train_step(micro)
    _, _, micro = next(batches)
    if at_allocator(trainer.cfg):
        measured = {"Allocated": state_bytes(trainer) + allocator_peak(trainer, micro)}
    else:
        tracker = FSDPMemTracker(trainer.model, trainer.optimizer)
        with tracker:
            trainer.train_step(micro)
        # the meta device holds no bytes (Muon's stacking probes shapes there): left out
        (peak,) = [v for device, v in tracker.get_tracker_snapshot("peak").items()
                   if str(device) != "meta"]
        measured = {str(getattr(kind, "value", kind)): nbytes for kind, nbytes in peak.items()
                    if kind != "Total"}
    return {**measured, "Pipeline Buffers": pipeline_buffers(trainer)}


def allocator_peak(trainer: Trainer, micro: list) -> int:
    """The most bytes the CPU allocator held at once during one step, beyond what it held
    when the step began."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.train_step(micro)
    return peak_live_bytes(prof)


def state_bytes(trainer: Trainer) -> int:
    """Bytes of the storages of this rank's parameters, gradients, buffers and optimizer
    state (what the tracker counts before a step)."""
    tensors = [*trainer.model.parameters(), *trainer.model.buffers(),
               *(p.grad for p in trainer.model.parameters()),
               *(v for state in trainer.optimizer.state.values() for v in state.values())]
    storages = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if isinstance(t, torch.Tensor):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def pipeline_buffers(trainer: Trainer) -> int:
    """Bytes of torch's pipeline receive buffers: made in the first step and kept, so the
    tracker of a later step does not see them; live throughout, they add to its peak."""
    schedule = getattr(trainer.executor, "schedule", None)
    if schedule is None:
        return 0
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    buffers = {}
    for stage in stages:
        for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
            for info in infos:
                if isinstance(info.buffer, torch.Tensor):
                    buffers[info.buffer.data_ptr()] = info.buffer.untyped_storage().nbytes()
    return sum(buffers.values())


def main(runs: list[list[str]]) -> None:
    """One rank of a measurement job: each run's flags -> a `MEASURED {json}` line with
    this rank's peak breakdown (bytes). Started by benchmarks/plan_accuracy.py and tests."""
    info = rank_info()
    setup_logging(info.rank)
    device = init_distributed(info)
    try:
        if len(runs) > 1 and any(at_allocator(parse_args(argv)) for argv in runs):
            raise ValueError("a run measured at the allocator needs a job of its own")
        for i, argv in enumerate(runs):
            cfg = parse_args(argv)
            with training(cfg, info, device) as trainer:  # the run's compiler settings too
                peak = measure_step(trainer)
            print("MEASURED " + json.dumps({"run": i, "rank": info.rank, "peak": peak}),
                  flush=True)
    finally:
        teardown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
