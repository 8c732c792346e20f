"""Peak-memory probes shared by the benchmarks: Linux RSS high-water, and the profiler's
allocation records (`loom.observability.profiling.peak_live_bytes`, which
`tests.plan_measure` uses too)."""

from __future__ import annotations

from pathlib import Path

from loom.observability.profiling import peak_live_bytes

__all__ = ["peak_live_bytes", "reset_rss_high_water", "rss_high_water"]


def rss_high_water() -> int:
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024


def reset_rss_high_water() -> int:
    """Reset the kernel's RSS high-water mark to the current RSS; returns it."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss_high_water()
