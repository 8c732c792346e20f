"""`--profile` (torch profiler) and `--pyinstrument-profiler`, both writing into the run folder.

The torch profiler skips `wait` steps, warms up for `warmup`, records `active` steps once,
then writes `profile/trace-rank<r>.json` (open in chrome://tracing or Perfetto) and
`profile/ops-rank<r>.txt` (the top operators). pyinstrument (pip install 'loom[profile]')
samples the Python stack of the whole loop into `pyinstrument-rank<r>.html` and `.txt`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

logger = logging.getLogger("loom")

SCHEDULE = (2, 2, 3)
"""(wait, warmup, active) steps of `--profile`; runs shorter than 7 steps start at once."""


def profile_schedule(total_steps: int) -> tuple[int, int, int]:
    wait, warmup, active = SCHEDULE
    if total_steps >= wait + warmup + active:
        return SCHEDULE
    warmup = 1 if total_steps > 1 else 0
    return 0, warmup, max(1, total_steps - warmup)


class NoProfiler:
    def step(self) -> None:
        pass


def _activities() -> list[ProfilerActivity]:
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        activities.append(ProfilerActivity.XPU)
    return activities


def _trace_writer(folder: Path, rank: int):
    def write(prof: torch.profiler.profile) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(folder / f"trace-rank{rank}.json"))
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        (folder / f"ops-rank{rank}.txt").write_text(table + "\n")
        logger.info("profile: %s", folder / f"trace-rank{rank}.json")
    return write


@contextlib.contextmanager
def stderr_silenced() -> Iterator[None]:
    """Point file descriptor 2 at /dev/null: kineto's C++ prints a "USDT: ... profiler_start"
    and "profiler_stop" line there whenever recording starts or stops."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class StepProfiler:
    """The torch profiler, each of whose steps (where recording starts and stops) runs under
    `quiet`."""

    def __init__(self, prof: torch.profiler.profile,
                 quiet: Callable[[], contextlib.AbstractContextManager]):
        self.prof, self.quiet = prof, quiet

    def step(self) -> None:
        with self.quiet():
            self.prof.step()


@contextlib.contextmanager
def torch_profile(outdir: Path, rank: int, total_steps: int,
                  verbose: bool = False) -> Iterator[StepProfiler]:
    wait, warmup, active = profile_schedule(total_steps)
    prof = torch.profiler.profile(
        activities=_activities(),
        schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=_trace_writer(outdir / "profile", rank))
    quiet = contextlib.nullcontext if verbose else stderr_silenced
    with quiet():
        prof.start()
    try:
        yield StepProfiler(prof, quiet)
    finally:
        with quiet():
            prof.stop()


@contextlib.contextmanager
def pyinstrument_profile(outdir: Path, rank: int) -> Iterator[None]:
    from pyinstrument import Profiler

    profiler = Profiler()
    profiler.start()
    try:
        yield
    finally:
        profiler.stop()
        (outdir / f"pyinstrument-rank{rank}.html").write_text(profiler.output_html())
        (outdir / f"pyinstrument-rank{rank}.txt").write_text(profiler.output_text())
        logger.info("pyinstrument profile: %s", outdir / f"pyinstrument-rank{rank}.html")


@contextlib.contextmanager
def maybe_profile(profile: bool, pyinstrument: bool, outdir: Path, rank: int,
                  total_steps: int, verbose: bool = False) -> Iterator[NoProfiler | StepProfiler]:
    """The profilers that are on, around the training loop; call `.step()` after each step.
    kineto's start/stop lines are hidden unless `verbose`."""
    with contextlib.ExitStack() as stack:
        if pyinstrument:
            stack.enter_context(pyinstrument_profile(outdir, rank))
        if profile:
            yield stack.enter_context(torch_profile(outdir, rank, total_steps, verbose))
        else:
            yield NoProfiler()


def peak_live_bytes(prof: profile) -> int:
    """Most bytes live at once during a `profile(profile_memory=True)` region, from the
    profiler's raw allocation (+) and free (-) records in time order (its per-op view folds
    allocations into the ops, losing their order). Frees of tensors made before the region
    count as nothing."""
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in records:
        live += nbytes
        peak = max(peak, live)
    return peak
