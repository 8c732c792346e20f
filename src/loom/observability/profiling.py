"""`--profile` (torch profiler) and `--pyinstrument-profiler`, both writing into the run folder.

The torch profiler skips `wait` steps, warms up for `warmup`, records `active` steps
(`repeat` cycles; the --profile-* flags), then writes `profile/trace-rank<r>.json` (open in
chrome://tracing or Perfetto) and `profile/ops-rank<r>.txt` (the top operators).
pyinstrument (pip install 'loom[profile]') samples the Python stack of the whole loop into
`pyinstrument-rank<r>.html` and `.txt`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from loom.config import OutputConfig

logger = logging.getLogger("loom")

@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    """`--profile`'s schedule and what it records (the --profile-* flags)."""

    wait: int = 2
    """Steps skipped before each cycle; then `warmup` traced but discarded."""
    warmup: int = 2
    active: int = 3
    """Steps recorded per cycle, `repeat` cycles."""
    repeat: int = 1
    memory: bool = False
    shapes: bool = False
    stack: bool = False
    flops: bool = False
    modules: bool = False

    @classmethod
    def from_config(cls, o: OutputConfig) -> ProfileOptions:
        """Each field from its flag, `--profile-<field>`."""
        return cls(wait=o.profile_wait, warmup=o.profile_warmup, active=o.profile_active,
                   repeat=o.profile_repeat, memory=o.profile_memory, shapes=o.profile_shapes,
                   stack=o.profile_stack, flops=o.profile_flops, modules=o.profile_modules)


def profile_schedule(total_steps: int, options: ProfileOptions = ProfileOptions()
                     ) -> tuple[int, int, int]:
    """(wait, warmup, active) steps; a run too short for them starts recording at once, so
    even a 1-step run leaves a trace."""
    wait, warmup, active = options.wait, options.warmup, options.active
    if total_steps >= wait + warmup + active:
        return wait, warmup, active
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
    """Each recorded cycle's trace and top-operator table; cycles after the first (with
    --profile-repeat) get their number in the file name."""
    cycles = itertools.count()

    def write(prof: torch.profiler.profile) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        cycle = next(cycles)
        suffix = f"rank{rank}" if cycle == 0 else f"rank{rank}-cycle{cycle}"
        prof.export_chrome_trace(str(folder / f"trace-{suffix}.json"))
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        (folder / f"ops-{suffix}.txt").write_text(table + "\n")
        logger.info("profile: %s", folder / f"trace-{suffix}.json")
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
def torch_profile(outdir: Path, rank: int, total_steps: int, verbose: bool = False,
                  options: ProfileOptions = ProfileOptions()) -> Iterator[StepProfiler]:
    wait, warmup, active = profile_schedule(total_steps, options)
    prof = torch.profiler.profile(
        activities=_activities(),
        schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active,
                                         repeat=options.repeat),
        on_trace_ready=_trace_writer(outdir / "profile", rank),
        profile_memory=options.memory, record_shapes=options.shapes,
        with_stack=options.stack, with_flops=options.flops, with_modules=options.modules)
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
def maybe_profile(out: OutputConfig, outdir: Path, rank: int,
                  total_steps: int) -> Iterator[NoProfiler | StepProfiler]:
    """The profilers that are on, around the training loop; call `.step()` after each step.
    kineto's start/stop lines are hidden unless --verbose; with --profile-rank0-only the
    torch profiler runs on rank 0 alone."""
    with contextlib.ExitStack() as stack:
        if out.pyinstrument_profiler:
            stack.enter_context(pyinstrument_profile(outdir, rank))
        if out.profile and (rank == 0 or not out.profile_rank0_only):
            yield stack.enter_context(torch_profile(outdir, rank, total_steps, out.verbose,
                                                    ProfileOptions.from_config(out)))
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
