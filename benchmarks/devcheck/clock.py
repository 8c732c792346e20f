"""Step times for the device check's baselines, the same way for every one of them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class StepClock:
    """Device events around each step on CUDA, so no step waits for the device; the host
    clock elsewhere (the CPU rehearsal, where the host is the device)."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @contextmanager
    def step(self) -> Iterator[None]:
        start = self._now()
        yield
        self.marks.append((start, self._now()))

    def summary(self, warmup: int) -> dict:
        """The median step after `warmup` steps (the last one if none is left), the first
        step's time and the step count; synchronises once, after the last step."""
        if self.cuda:
            torch.cuda.synchronize()
            times = [a.elapsed_time(b) / 1e3 for a, b in self.marks]
        else:
            times = [b - a for a, b in self.marks]
        timed = times[warmup:] or times[-1:]
        return {"step_s": statistics.median(timed), "first_step_s": times[0],
                "steps": len(times)}
