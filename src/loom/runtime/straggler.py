"""A rank that is slow but alive, named: each rank's own step time, and a watch over it.

In a synchronous job every rank's wall-clock step time is the same: a slow rank delays the
others at each collective, and they wait. What differs is how much of the step a rank spent
waiting. A collective completes when its last rank enters it, so a rank's wait in
collective i is (the last arrival at i) - (its own arrival at i). torch's Flight Recorder
stamps each rank's arrival (`time_created_ns`). Measured from the previous step's sync
point, which every rank leaves together, these offsets are comparable across hosts without
synchronised clocks. Summed over the step's collectives, a rank's wait is C - S_r, where
S_r is the sum of its offsets and C the sum of the last arrivals; the rank that arrives
last (the straggler) waits about nothing, so C is taken as the largest S_r. A rank's own
step time is then the step's length less its wait.

A rank descheduled just after leaving the sync point reads a late origin, which shifts
each of its K offsets, so its wait is overstated K times over. The same sums measured back
from the step's own sync point (U_r, the time from each arrival to the end) give a second
estimate, U_r - min U, which that delay does not touch (a late end moves the second and not
the first). A late mark only ever adds wait, so of the two the one with the smaller total
wait is kept.

loom's own FSDP exchanges over gloo (point-to-point, which the recorder does not see, and
asynchronous, so that a rank waits in them long after it entered them) are timed where the
rank waits instead (`loom.runtime.flight.blocked`). Four floats (S_r, U_r, the count and the time
blocked) travel in the logging steps' timing gather; nothing is added to the other steps.

The window that begins at a run's first sync point is shown but not judged: it also holds
the first step's one-off work after that point (the optimizer's first update, which
allocates its state, the first metrics row, recorder dump and timing gather), and ranks'
own times there were 2-6x their later ones and up to 1.9x apart on otherwise even 2-rank
runs. With a logging step every step, a slow rank is then named one interval later, still
within five; with sparser logging that window is never a logging step's.

The measure assumes every rank enters the same collectives (data parallelism, or
symmetric TP/CP groups); when the counts differ (pipeline stages, a wrapped recorder
buffer) the step is left unmeasured.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("loom")

RATIO = 1.3
"""A rank this many times slower than the median of the other ranks is lagging."""
PATIENCE = 3
"""Lagging logging intervals, out of the last PATIENCE + 1, before the rank is named: one
slow step is noise, and one noisy interval (a rank descheduled at the sync point, which
shifts its arrival offsets) must not hide a rank that lags in all the others."""


def arrivals(times_ns: list[int], since_ns: int, until_ns: int) -> tuple[float, float, int]:
    """(sum of offsets from `since_ns`, sum of offsets to `until_ns`, both in s, count) of
    the collectives this rank entered in (since_ns, until_ns], from
    `loom.runtime.flight.arrival_times`."""
    inside = [t for t in times_ns if since_ns < t <= until_ns]
    return (sum(t - since_ns for t in inside) / 1e9, sum(until_ns - t for t in inside) / 1e9,
            len(inside))


def own_step_times(window_s: float, since: list[float], until: list[float],
                   counts: list[int], blocked: list[float]) -> list[float] | None:
    """Each rank's step time less its wait for the others: in recorded collectives, from
    its offset sums `since` (S_r) and `until` (U_r), and in loom's own exchanges,
    `blocked` (see the module's docstring); None when the ranks did not enter the same
    number of recorded collectives."""
    if len(set(counts)) != 1:
        return None
    from_start = [max(since) - s for s in since]
    to_end = [u - min(until) for u in until]
    waits = min(from_start, to_end, key=sum)
    return [max(0.0, window_s - w - b) for w, b in zip(waits, blocked, strict=True)]


def spread(times: list[float]) -> dict[str, float]:
    """The row's keys: fastest, median and slowest rank's own step time, and which rank."""
    slowest = max(range(len(times)), key=times.__getitem__)
    return {"train/rank_dt_min": min(times), "train/rank_dt_median": statistics.median(times),
            "train/rank_dt_max": times[slowest], "train/slowest_rank": slowest}


def lagging(times: list[float], ratio: float = RATIO) -> list[int]:
    """Ranks at least `ratio` times the median of the *other* ranks: with two ranks, a
    median that includes the slow rank itself would halve the gap it is judged by."""
    if len(times) < 2:
        return []
    out = []
    for rank, t in enumerate(times):
        others = statistics.median(times[:rank] + times[rank + 1:])
        if others > 0 and t >= ratio * others:
            out.append(rank)
    return out


@dataclass
class StragglerWatch:
    """Keeps which ranks lagged in each of the last `patience` + 1 logging intervals; names
    a rank once when it lagged in `patience` of them. The same on every rank (it sees the
    gathered times); rank 0 logs."""

    hosts: list[str]
    ratio: float = RATIO
    patience: int = PATIENCE
    log: bool = True
    recent: deque[set[int]] = field(default_factory=deque)
    found: dict[int, dict[str, Any]] = field(default_factory=dict)

    def observe(self, step: int, times: list[float]) -> list[int]:
        """Record one logging interval; returns the ranks named for the first time."""
        slow = set(lagging(times, self.ratio))
        self.recent.append(slow)
        while len(self.recent) > self.patience + 1:
            self.recent.popleft()
        named = []
        for rank in sorted(slow):
            others = statistics.median(times[:rank] + times[rank + 1:])
            factor = times[rank] / others
            if rank in self.found:
                self.found[rank]["max_ratio"] = max(self.found[rank]["max_ratio"], factor)
            elif sum(rank in s for s in self.recent) >= self.patience:
                self.found[rank] = {"rank": rank, "host": self.host(rank), "step": step,
                                    "max_ratio": factor}
                named.append(rank)
                if self.log:
                    logger.warning(
                        "straggler: rank %d (%s) took %.2fx the other ranks' median step "
                        "time (%.1f ms vs %.1f ms, waits excluded) in %d of the last %d "
                        "logging intervals, up to step %d", rank, self.host(rank), factor,
                        times[rank] * 1e3, others * 1e3, self.patience, len(self.recent), step)
        return named

    def host(self, rank: int) -> str:
        return self.hosts[rank] if rank < len(self.hosts) else "?"

    def summary(self) -> list[dict[str, Any]]:
        """summary.json's `stragglers`: rank, host, the step it was named at, worst ratio."""
        return [self.found[r] for r in sorted(self.found)]
