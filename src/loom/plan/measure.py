"""Measured peak tensor memory of a real training step, with the planner's accounting.

The same FSDPMemTracker that follows the fake trace follows `Trainer.train_step` on real
tensors (the whole step, optimizer included), so prediction and measurement count the
same thing: bytes of live tensor storages per category at the step's peak.
"""

from __future__ import annotations

import json
import sys

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

from loom.cli import setup_logging
from loom.config import parse_args
from loom.mesh import ParallelDims
from loom.plan.trace import Breakdown
from loom.runtime import init_distributed, rank_info, teardown
from loom.train import Trainer


def measure_step(trainer: Trainer) -> Breakdown:
    """Peak bytes of this rank during its second training step (the first creates the
    optimizer state)."""
    batches = trainer.batches()
    _, _, micro = next(batches)
    trainer.train_step(micro)
    _, _, micro = next(batches)
    tracker = FSDPMemTracker(trainer.model, trainer.optimizer)
    with tracker:
        trainer.train_step(micro)
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    measured = {str(getattr(kind, "value", kind)): nbytes for kind, nbytes in peak.items()
                if kind != "Total"}
    return {**measured, "Pipeline Buffers": pipeline_buffers(trainer)}


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
        for i, argv in enumerate(runs):
            cfg = parse_args(argv)
            trainer = Trainer(cfg, info, ParallelDims.from_config(cfg.parallel, info.world_size),
                              device)
            try:
                peak = measure_step(trainer)
            finally:
                trainer.close()
            print("MEASURED " + json.dumps({"run": i, "rank": info.rank, "peak": peak}),
                  flush=True)
    finally:
        teardown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
