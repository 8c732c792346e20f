"""Weighted mixtures of datasets (`--dataset a:0.5,b:0.3,c:0.2`): one global sequence of
packed windows in which the sources take turns by a fixed schedule, not by sampling.

The weights are exact fractions; over a cycle of D windows (D the weights' common
denominator) source s takes exactly w_s * D of them, spread evenly (smooth weighted
round-robin), so every D consecutive windows hold the ratios exactly. Window p of the
sequence is a pure function of p: the global-order sampler hands out positions in order,
and a resumed run, at any dp degree with the same global batch, continues the same
sequence from its sample count. Each source is read in its own seeded order, a new one for
each pass over it.

What happens when a source has given every window (`--mixture-exhausted`): `restart` reads
it again in a new order (the mixture's epoch ends when the longest-lasting source has been
read once); `stop` ends the epoch when the first source runs out; `drop` leaves the source
out and shares its turns among the others by their weights (the epoch ends when all have
run out). The trainer's epoch is the whole global batches of that length; the positions
continue across epochs, so the sequence never skips a window.
"""

from __future__ import annotations

import bisect
import logging
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from loom.config.mixture import parse_mixture
from loom.errors import ConfigError

__all__ = ["Mixture", "check_mixture_state", "mixture_state", "parse_mixture"]

logger = logging.getLogger("loom")

POLICIES = ("restart", "stop", "drop")


def cycle_of(weights: list[Fraction]) -> np.ndarray:
    """One cycle of the schedule: source indices, each exactly w * D times, spread evenly
    (smooth weighted round-robin: the source furthest behind its share goes next)."""
    period = math.lcm(*(w.denominator for w in weights))
    counts = [int(w * period) for w in weights]
    credit = [0] * len(counts)
    cycle = np.empty(period, dtype=np.int64)
    for t in range(period):
        credit = [c + n for c, n in zip(credit, counts, strict=True)]
        pick = max(range(len(credit)), key=lambda s: (credit[s], -s))
        credit[pick] -= period
        cycle[t] = pick
    return cycle


@dataclass
class Segment:
    """Positions [start, end) of an epoch scheduled by one cycle over the sources still in
    (all of them but under `drop`); `base`: each source's windows taken before `start`."""

    start: int
    end: int
    cycle: np.ndarray
    base: list[int]

    def __post_init__(self) -> None:
        self.period = len(self.cycle)
        n = int(self.cycle.max()) + 1 if self.period else 0
        n = max(n, len(self.base))
        onehot = np.zeros((n, self.period), dtype=np.int32)
        onehot[self.cycle, np.arange(self.period)] = 1
        self.prefix = np.concatenate([np.zeros((n, 1), dtype=np.int32),
                                      np.cumsum(onehot, axis=1, dtype=np.int32)], axis=1)
        self.per_cycle = self.prefix[:, -1]

    def taken(self, s: int, position: int) -> int:
        """Windows of source s taken before `position` (in this segment's range)."""
        q, r = divmod(position - self.start, self.period)
        return self.base[s] + q * int(self.per_cycle[s]) + int(self.prefix[s, r])

    def runs_out(self, s: int, size: int) -> int:
        """The position after which source s has given all `size` of its windows."""
        need = size - self.base[s]
        q, r = divmod(need - 1, int(self.per_cycle[s]))
        in_cycle = int(np.flatnonzero(self.cycle == s)[r])
        return self.start + q * self.period + in_cycle + 1


def plan_epoch(weights: list[Fraction], sizes: list[int], policy: str) -> list[Segment]:
    """The segments of one epoch of the mixture under `policy`."""
    if policy not in POLICIES:
        raise ConfigError(f"--mixture-exhausted {policy!r}: choose from {', '.join(POLICIES)}")
    full = Segment(0, 0, cycle_of(weights), [0] * len(sizes))
    ends = [full.runs_out(s, n) for s, n in enumerate(sizes)]
    if policy != "drop":
        full.end = max(ends) if policy == "restart" else min(ends)
        return [full]
    segments, active, base, start = [], list(range(len(sizes))), [0] * len(sizes), 0
    while active:
        share = sum(weights[s] for s in active)
        local = cycle_of([weights[s] / share for s in active])
        segment = Segment(start, 0, np.array([active[i] for i in local]), list(base))
        segment.end = min(segment.runs_out(s, sizes[s]) for s in active)
        base = [segment.taken(s, segment.end) for s in range(len(sizes))]
        active = [s for s in active if base[s] < sizes[s]]
        segments.append(segment)
        start = segment.end
    return segments


class Mixture(Dataset):
    """The window sequence of weighted sources. Index p is a global position, the run's
    sample p (the sampler hands out positions in order and without a gap between epochs:
    `ordered`); within it, mixture epoch p // len(self) and the schedule's position in
    that. Each source's windows come in a seeded order per pass and mixture epoch."""

    ordered = True
    """For `build_dataloader`: the order is this dataset's, never the sampler's shuffle."""

    def __init__(self, names: list[str], sources: list[Dataset], weights: list[Fraction],
                 policy: str, seed: int):
        self.names, self.sources, self.weights = names, sources, weights
        self.policy, self.seed = policy, seed
        self.sizes = [len(s) for s in sources]
        if min(self.sizes) == 0:
            empty = names[self.sizes.index(0)]
            raise ConfigError(f"--dataset: mixture source {empty} holds no window")
        self.segments = plan_epoch(weights, self.sizes, policy)
        self.starts = [seg.start for seg in self.segments]
        self.epoch_windows = self.taken_in_epoch(self.segments[-1].end)
        self.eot_id = int(getattr(sources[0], "eot_id", 0))
        self.orders: dict[tuple[int, int, int], torch.Tensor] = {}

    def __len__(self) -> int:
        return self.segments[-1].end

    def segment(self, position: int) -> Segment:
        return self.segments[max(0, bisect.bisect_right(self.starts, position) - 1)]

    def locate(self, position: int) -> tuple[int, int]:
        """(source, its window count so far) of the global position's window."""
        seg = self.segment(k := position % len(self))
        s = int(seg.cycle[(k - seg.start) % seg.period])
        return s, seg.taken(s, k)

    def taken_in_epoch(self, k: int) -> list[int]:
        seg = self.segment(k)  # k == len(self): the last segment's end
        return [seg.taken(s, k) for s in range(len(self.sources))]

    def windows_taken(self, positions: int) -> dict[str, int]:
        """Windows each source gave to the first `positions` global positions."""
        epochs, k = divmod(positions, len(self))
        part = self.taken_in_epoch(k)
        return {name: epochs * self.epoch_windows[s] + part[s]
                for s, name in enumerate(self.names)}

    def order(self, s: int, epoch: int, read: int) -> torch.Tensor:
        key = (s, epoch, read)
        if key not in self.orders:
            if len(self.orders) >= 2 * len(self.sources):
                self.orders.pop(next(iter(self.orders)))
            seed = hash((self.seed, s, epoch, read)) % 2**63  # ints: the same in every process
            self.orders[key] = torch.randperm(self.sizes[s],
                                              generator=torch.Generator().manual_seed(seed))
        return self.orders[key]

    def source_window(self, position: int) -> tuple[int, int]:
        """(source, window index in it) at a global position: the ids a test compares."""
        s, j = self.locate(position)
        read, i = divmod(j, self.sizes[s])
        return s, int(self.order(s, position // len(self), read)[i])

    def __getitem__(self, position: int) -> dict[str, Any]:
        s, i = self.source_window(position)
        return self.sources[s][i]


def mixture_state(dataset: Any, samples_seen: int) -> dict[str, Any]:
    """The checkpoint's record of a mixture ({} for one dataset): its policy and each
    source's weight and windows taken, which a resumed run checks against its own."""
    if not isinstance(dataset, Mixture):
        return {}
    taken = dataset.windows_taken(samples_seen)
    return {"mixture": {"policy": dataset.policy, "sources": [
        {"name": n, "weight": str(w), "windows": taken[n]}
        for n, w in zip(dataset.names, dataset.weights, strict=True)]}}


def mixture_summary(dataset: Any, samples_seen: int, seq_len: int) -> dict[str, Any]:
    """summary.json's `data_sources` for a mixture ({} for one dataset): each source's
    weight, windows and tokens seen (a window's seq_len inputs, as train/tokens counts)
    and its share of the windows."""
    if not isinstance(dataset, Mixture) or samples_seen == 0:
        return {}
    taken = dataset.windows_taken(samples_seen)
    return {"data_sources": {name: {"weight": float(w), "windows": taken[name],
                                    "tokens": taken[name] * seq_len,
                                    "share": taken[name] / samples_seen}
                             for name, w in zip(dataset.names, dataset.weights, strict=True)}}


def check_mixture_state(dataset: Any, saved: dict[str, Any], samples_seen: int,
                        new_data: bool = False) -> None:
    """A resumed mixture must be the checkpoint's: same sources, weights and policy, so
    the same position gives the same window (its sources' positions then agree). With
    `new_data` (--resume-new-data) another mixture continues from the same position of its
    own sequence: each source's windows are counted as the new weights would have taken
    them, so a source may repeat or skip windows it had given; the log says so."""
    mine, theirs = mixture_state(dataset, samples_seen), saved.get("mixture")
    if (mine.get("mixture") or None) == theirs:
        return
    if not new_data:
        raise ConfigError("resume: the --dataset mixture or --mixture-exhausted differs from "
                          "the checkpoint's, whose window sequence it cannot continue; pass "
                          "--resume-new-data to continue the new one from the same position")
    logger.info("--resume-new-data: the data was %s, now %s, continued at window %d of "
                "its sequence", _shown(theirs), _shown(mine.get("mixture")), samples_seen)


def _shown(state: dict[str, Any] | None) -> str:
    """A mixture's record as the log names it."""
    if not state:
        return "one dataset"
    return f"a mixture ({state['policy']}) of " + ", ".join(
        f"{s['name']}:{s['weight']}" for s in state["sources"])
