"""What the training loop reads: each step's micro-batches, from the loop's data position.

The position is the loop's (`LoopState.samples_seen`, in global samples), so a resume reads
on exactly where the checkpoint left off, and a live recovery that moves the loop (a
replica group taking a healthy group's position) moves the reads with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from loom.data.streaming import StreamLoader
from loom.trainer.step import Batch, ahead_on_device

if TYPE_CHECKING:
    from loom.trainer.trainer import Trainer

Step = tuple[int, int, list[Batch]]
"""(epoch, step in the epoch, the step's micro-batches)."""


def batches_from(t: Trainer, samples_seen: int) -> Iterator[Step]:
    """The steps from global sample `samples_seen` on, epoch by epoch: step k of an epoch
    holds global samples k*G ... k*G+G-1 of the epoch's order."""
    first_epoch, first_step = divmod(samples_seen // t.global_batch, t.steps_per_epoch)
    for epoch in range(first_epoch, t.cfg.train.epochs):
        skip = first_step if epoch == first_epoch else 0
        t.loader.sampler.set_epoch(epoch, start_step=skip * t.accum)
        micro = iter(t.loader)
        for bidx in range(skip, t.steps_per_epoch):
            yield epoch, bidx, [next(micro) for _ in range(t.accum)]


def batches(t: Trainer) -> Iterator[Step]:
    """`batches_from` the loop's position, following the loop: where a live recovery moved
    it (`share_state`), the next step reads from there."""
    while True:
        start = t.loop.samples_seen
        for step in batches_from(t, start):
            yield step
            if t.loop.samples_seen != start + t.global_batch:
                break  # the loop was moved under us: read on from where it is now
            start = t.loop.samples_seen
        else:
            return


def steps(t: Trainer) -> Iterator[Step]:
    """`batches()`, copied to an accelerator one step ahead (the copy of step k+1 is queued
    behind step k's work, so the step never waits for its data). Not for a stream, whose
    checkpointed position would then count the step drawn ahead, nor for replica groups,
    whose position a live recovery may move after the draw."""
    if (t.device.type == "cpu" or isinstance(t.loader, StreamLoader)
            or t.dims.replica_groups > 1):
        return batches(t)
    return ahead_on_device(batches(t), t.device)


def steps_until(t: Trainer, total: int) -> Iterator[Step]:
    """`steps()` while the loop is short of `total`, checked before each draw (a live
    recovery may move the loop on by several steps)."""
    drawn = steps(t)
    while t.loop.step < total:
        found = next(drawn, None)
        if found is None:
            return
        yield found
