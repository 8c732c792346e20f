"""Health statistics: gradient and parameter norms, extremes and non-finite counts (one
foreach norm and one aminmax per tensor, left on the device), and memory use."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

GIB = 2**30
HEALTH_KEYS = ("grad/norm", "grad/max_abs", "grad/nonfinite",
               "param/norm", "param/max_abs", "param/nonfinite")


def local_shards(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)
    return [t.detach() for t in local if t.numel()]


def tensor_stats(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """(L2 norm, max |x|, count of tensors holding a NaN/Inf) over this rank's local shards,
    left on the device, no host sync. aminmax, not the inf-norm: 20x faster on CPU."""
    local = local_shards(tensors)
    if not local:
        return torch.zeros(3, device=device)
    norms = torch.stack(torch._foreach_norm(local, 2, dtype=torch.float32))
    extremes = torch.stack([torch.stack(torch.aminmax(t)).float() for t in local])  # (n, 2)
    maxes = extremes.abs().amax(dim=1)  # NaN propagates, so a NaN tensor counts as nonfinite
    return torch.stack([norms.norm(), maxes.max(), (~maxes.isfinite()).sum().float()])


def peak_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def current_rss() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    except OSError:
        return peak_rss()


def memory_stats(device: torch.device) -> dict[str, float]:
    """Allocated / reserved device memory (current and peak, GiB); process RSS on the CPU."""
    if device.type in ("cuda", "xpu"):
        mod = getattr(torch, device.type)
        return {"train/mem_alloc": mod.memory_allocated(device) / GIB,
                "train/mem_alloc_peak": mod.max_memory_allocated(device) / GIB,
                "train/mem_reserved": mod.memory_reserved(device) / GIB,
                "train/mem_reserved_peak": mod.max_memory_reserved(device) / GIB}
    rss = current_rss()  # the kernel's high-water mark can lag the current value
    return {"train/mem_rss": rss / GIB, "train/mem_rss_peak": max(rss, peak_rss()) / GIB}
