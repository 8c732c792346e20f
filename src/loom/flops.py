"""Model FLOPs per step (counted, not guessed), the device's peak FLOP/s, and MFU.

The count is forward + backward of the *unsharded* model at the real (batch, seq) shape,
run under fake tensors (nothing allocated, so it cannot OOM) with the math attention
kernel forced so attention's matmuls are seen (full T x T, no causal discount). These are
model FLOPs: activation recompute is not counted, so MFU is model, not hardware, FLOPs
utilisation.

The CPU has no datasheet peak: a short matmul benchmark measures it once per machine,
dtype and thread count, cached as `peak_flops.json` in loom's cache folder ($LOOM_CACHE_DIR,
default `~/.cache/loom`). Delete that file to measure again.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

logger = logging.getLogger("loom")

PROBE_TOKENS = 32
"""Sequence length of the real fallback probe (batch 1); its count is scaled by tokens."""

PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # device-name fragment -> dense TFLOP/s per device as torch sees it; first match wins.
    # fp32 is plain fp32 (torch's default matmul precision, no TF32).
    "H100 NVL": {"bf16": 835.0, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.0, "fp32": 51.0},
    "H100": {"bf16": 989.4, "fp32": 66.9},
    "H200": {"bf16": 989.4, "fp32": 66.9},
    "B200": {"bf16": 2250.0, "fp32": 80.0},
    "A100": {"bf16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp32": 91.6},
    "MI355X": {"bf16": 2500.0, "fp32": 157.3},
    "MI325X": {"bf16": 1307.4, "fp32": 163.4},
    "MI300X": {"bf16": 1307.4, "fp32": 163.4},
    "MI250X": {"bf16": 191.5, "fp32": 47.9},  # per GCD (one torch device)
    "Max 1550": {"bf16": 298.2, "fp32": 22.9},  # Intel PVC, per tile: 448 EUs x 512 x 1.3 GHz
}


@dataclass(frozen=True)
class FlopCount:
    """Forward + backward FLOPs of one step of the whole (unsharded) model."""

    flops: float
    exact: bool
    """False when the scaled probe was used: attention is under-counted, MFU a lower bound."""


def _train_step_flops(model: nn.Module, tokens: torch.Tensor) -> int:
    """FLOPs of logits -> cross-entropy -> backward, math attention kernel forced."""
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
    return counter.get_total_flops()


def _fake_count(build_model: Callable[[], nn.Module], batch: int, seq: int) -> float:
    with FakeTensorMode():
        model = build_model()
        return float(_train_step_flops(model, torch.zeros(batch, seq, dtype=torch.long)))


def _probe_count(build_model: Callable[[], nn.Module], batch: int, seq: int) -> float:
    probe = min(seq, PROBE_TOKENS)
    model = build_model()
    return _train_step_flops(model, torch.zeros(1, probe, dtype=torch.long)) * batch * seq / probe


def count_step_flops(build_model: Callable[[], nn.Module], batch: int, seq: int) -> FlopCount:
    """Count under fake tensors; if that fails, a small real probe scaled by tokens."""
    try:
        return FlopCount(_fake_count(build_model, batch, seq), exact=True)
    except Exception as e:  # any failure of the fake run; the probe is the documented fallback
        logger.warning("FLOP count under fake tensors failed (%s: %s); using a %d-token real "
                       "probe scaled by tokens: attention is under-counted and MFU is a lower "
                       "bound", type(e).__name__, str(e).splitlines()[0][:200], PROBE_TOKENS)
    return FlopCount(_probe_count(build_model, batch, seq), exact=False)


def dtype_key(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "bf16"


def table_peak(device_name: str, dtype: torch.dtype) -> float | None:
    """Datasheet peak FLOP/s of a known accelerator, else None."""
    for fragment, peaks in PEAK_TFLOPS.items():
        if fragment.lower() in device_name.lower():
            return peaks[dtype_key(dtype)] * 1e12
    return None


def device_name(device: torch.device) -> str:
    if device.type in ("cuda", "xpu"):
        return getattr(torch, device.type).get_device_name(device)
    return cpu_model_name() if device.type == "cpu" else device.type


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def synchronizer(device: torch.device) -> Callable[[], None]:
    """Waits for the device's queued work (a no-op on the CPU, which runs synchronously)."""
    if device.type in ("cuda", "xpu", "mps"):
        return getattr(torch, device.type).synchronize
    return lambda: None


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, seconds: float = 0.1) -> float:
    """Best FLOP/s of square matmuls over a few sizes (small ones win on CPU caches)."""
    sizes = (256, 512, 1024) if device.type == "cpu" else (4096, 8192)
    best, sync = 0.0, synchronizer(device)
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        a @ b
        sync()
        deadline, reps = time.perf_counter() + seconds, 0
        while reps < 3 or time.perf_counter() < deadline:
            start = time.perf_counter()
            a @ b
            sync()
            best = max(best, 2 * n**3 / (time.perf_counter() - start))
            reps += 1
    return best


def measured_peak(device: torch.device, dtype: torch.dtype, cache: Path) -> float:
    """The measured matmul peak for this machine, dtype and thread count, cached."""
    path = cache / "peak_flops.json"
    key = (f"{platform.node()}|{device_name(device)}|{dtype_key(dtype)}|"
           f"threads={torch.get_num_threads()}|torch={torch.__version__}")
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = measure_matmul_peak(device, dtype)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1) + "\n")
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("could not cache the measured peak in %s: %s", path, e)
    return known[key]


@dataclass(frozen=True)
class Peak:
    flops: float
    source: str
    """'datasheet' or 'measured'."""


def peak_flops(device: torch.device, dtype: torch.dtype, cache: Path) -> Peak:
    """Datasheet peak of a known accelerator; a measured matmul peak otherwise."""
    name = device_name(device)
    known = table_peak(name, dtype)
    if known is not None:
        return Peak(known, "datasheet")
    if device.type != "cpu":
        logger.warning("no datasheet peak for %r; MFU uses a measured matmul peak", name)
    return Peak(measured_peak(device, dtype, cache), "measured")


def mfu_percent(flops_per_rank: float, seconds: float, peak: float) -> float:
    """Model FLOPs utilisation of one rank over one step, in percent of its peak."""
    return 100.0 * flops_per_rank / seconds / peak
