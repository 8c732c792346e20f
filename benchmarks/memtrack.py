"""Peak-memory probes shared by the benchmarks (Linux RSS high-water and profiler records)."""

from __future__ import annotations

from pathlib import Path

from torch.profiler import profile


def rss_high_water() -> int:
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024


def reset_rss_high_water() -> int:
    """Reset the kernel's RSS high-water mark to the current RSS; returns it."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss_high_water()


def peak_live_bytes(prof: profile) -> int:
    """Most bytes live at once, from the profiler's raw allocation (+) and free (-) records
    (its per-op view folds allocations into the ops, losing their order)."""
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in records:
        live += nbytes
        peak = max(peak, live)
    return peak
