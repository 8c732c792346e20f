"""Health statistics: gradient and parameter norms, extremes and non-finite counts (a
foreach norm over all tensors and their extremes, left on the device), logits and input
extremes, and memory use. Computed at their interval only (by default the logging steps),
never every step."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from loom.models.registry import spec_of

GIB = 2**30
HEALTH_KEYS = ("grad/norm", "grad/max_abs", "grad/nonfinite",
               "param/norm", "param/max_abs", "param/nonfinite")


def local_shards(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)
    return [t.detach() for t in local if t.numel()]


def tensor_stats(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """(L2 norm, max |x|, count of tensors holding a NaN/Inf) over this rank's local shards,
    left on the device, no host sync. One foreach L2 norm over all tensors, and their
    extremes (`max_abs`)."""
    local = local_shards(tensors)
    if not local:
        return torch.zeros(3, device=device)
    norms = torch.stack(torch._foreach_norm(local, 2, dtype=torch.float32))
    maxes = max_abs(local, per_tensor=local[0].device.type == "cpu")
    return torch.stack([norms.norm(), maxes.max(), (~maxes.isfinite()).sum().float()])


def max_abs(local: list[torch.Tensor], per_tensor: bool) -> torch.Tensor:
    """Each tensor's max |x| in fp32: NaN for a tensor holding a NaN, inf for one holding an
    Inf. On an accelerator one foreach inf-norm, a handful of host operators however many
    tensors there are (one aminmax per tensor was ~450 on preset s). `per_tensor` (the
    CPU): one aminmax per tensor instead, as torch's CPU inf-norm, foreach or not, is a
    slow reduction: 15 ms for the debug model's 8.6M gradients against 1.4 ms for
    aminmax (Zen 4 EPYC, 2 threads), i.e. 28 ms of a 120 ms logging step for gradients
    and parameters."""
    if not per_tensor:
        return torch.stack(torch._foreach_norm(local, float("inf"), dtype=torch.float32))
    lows, highs = zip(*(torch.aminmax(t) for t in local), strict=True)
    return torch.maximum(torch.stack(highs).float(), -torch.stack(lows).float())


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


LOGITS_KEYS = ("logits/max_abs", "logits/nonfinite")
HF_HEAD = "lm_head"
"""The output head's name in Hugging Face models (a native family's spec names its own)."""


def output_heads(model: nn.Module) -> list[nn.Module]:
    """The output heads of this rank's model part(s): the family's, or a Hugging Face
    model's `lm_head`."""
    spec = spec_of(model)
    if spec is not None and spec.parts is not None:
        head = spec.output(model)
        return [] if head is None else [head]
    if isinstance(model, nn.ModuleList) and spec is None:
        return [h for part in model for h in output_heads(part)]
    return [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == HF_HEAD]


class LogitsTracker:
    """--track-logits: max |logit| and the count of non-finite logits over this rank's
    logits (its vocabulary shard under loss-parallel) in a training step, from a forward hook
    on the output head. Kept on the device and folded over micro-batches, so it adds no host
    sync; evaluation forwards (no grad) and the fused head (which returns the loss) are
    skipped, and a step whose head never ran has no value."""

    def __init__(self) -> None:
        self.stats: torch.Tensor | None = None
        self.handles: list[torch.utils.hooks.RemovableHandle] = []

    def attach(self, model: nn.Module) -> None:
        heads = output_heads(model)
        self.handles = [h.register_forward_hook(self._record, with_kwargs=True) for h in heads]

    def _record(self, module: nn.Module, args: Any, kwargs: dict[str, Any],
                output: Any) -> None:
        if not torch.is_grad_enabled() or kwargs.get("apply") is not None:
            return
        logits = output.to_local() if isinstance(output, DTensor) else output
        if not isinstance(logits, torch.Tensor):
            return
        x = logits.detach()
        stats = torch.stack([x.abs().amax().float(), (~x.isfinite()).sum().float()])
        if self.stats is None:
            self.stats = stats
        else:  # fmax would drop a NaN; maximum keeps it
            self.stats = torch.stack([torch.maximum(self.stats[0], stats[0]),
                                      self.stats[1] + stats[1]])

    def take(self) -> torch.Tensor | None:
        """The step's (max |logit|, non-finite count), and a fresh start for the next."""
        stats, self.stats = self.stats, None
        return stats

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


INPUT_KEYS = ("input/min/high", "input/min/low", "input/max/high", "input/max/low")
"""The inputs' smallest and largest token id as exact float parts (`exact_float_parts`)."""


def input_range(batches: Iterable[dict[str, torch.Tensor]], device: torch.device
                ) -> torch.Tensor:
    """Smallest and largest token id in this rank's inputs of the step, as exact float
    parts on `device` (read with the step's other columns): out-of-vocabulary ids show up
    here first. The loader's host tensors, or their device copies when prefetched."""
    extremes = torch.stack([torch.stack(torch.aminmax(b["input"])) for b in batches])
    lo, hi = extremes[:, 0].min(), extremes[:, 1].max()
    return torch.cat([exact_float_parts(lo), exact_float_parts(hi)]).to(device)


def exact_float_parts(count: torch.Tensor) -> torch.Tensor:
    """An int64 count as two float32 values (whole multiples of 2**24, and the rest), so it
    can ride on the step's one float host read and still come back exact."""
    return torch.stack([count // 2**24, count % 2**24]).float()
