"""Model FLOPs per step (counted, not guessed), the device's peak FLOP/s, and MFU.

The count is forward + backward of the *unsharded* model at the real (batch, seq) shape,
run on the meta device or under fake tensors (nothing allocated, so it cannot OOM) with the
math attention kernel forced so attention's matmuls are seen (full T x T, no causal
discount). The count
runs in bf16, where MoE experts take `torch._grouped_mm` (FLOPs: 2 x routed rows x in x
out, i.e. tokens x top-k; formula registered below), so MoE counts are exact too. These are
model FLOPs: activation recompute is not counted, so MFU is model, not hardware, FLOPs
utilisation.

The CPU has no datasheet peak: a matmul benchmark measures it per machine, dtype and
thread count, in rounds until the two best rounds agree within 10% while the process's
threads spent at least 90% of their runnable time on a CPU rather than queued behind other
processes (otherwise the machine was busy). Busyness is read from the kernel's run-queue
accounting, not from CPU time over wall time x threads: a kernel that keeps only some of
its threads busy (bf16 on AMX at 2 threads keeps one) is not a busy machine. Only such a clean
measurement is cached, as `peak_flops_v2.json` in loom's cache folder ($LOOM_CACHE_DIR,
default `~/.cache/loom`). An MFU above 100% means the peak (or the count) is wrong: the
peak is measured again, a warning is logged once, and such a reading is never reported.
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
from torch.utils.flop_counter import FlopCounterMode, flop_registry, register_flop_formula

from loom.numerics.precision import default_dtype
from loom.observability.devices import known_device

logger = logging.getLogger("loom")

PROBE_TOKENS = 32
"""Sequence length of the real fallback probe (batch 1); its count is scaled by tokens."""


@dataclass(frozen=True)
class FlopCount:
    """Forward + backward FLOPs of one step of the whole (unsharded) model."""

    flops: float
    exact: bool
    """False when the scaled probe was used: attention is under-counted, MFU a lower bound."""


if hasattr(torch.ops.aten, "_grouped_mm") and torch.ops.aten._grouped_mm not in flop_registry:
    @register_flop_formula(torch.ops.aten._grouped_mm)
    def _grouped_mm_flops(a_shape: torch.Size, b_shape: torch.Size, *args: object,
                          out_shape: torch.Size | None = None, **kwargs: object) -> int:
        """2D x 3D with offsets (MoE experts): every row of `a` meets one group's (K, N)."""
        if len(a_shape) == 2 and len(b_shape) == 3:
            return 2 * a_shape[0] * a_shape[1] * b_shape[-1]
        if len(a_shape) == 3 and len(b_shape) == 3:  # batched groups
            return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[-1]
        return 2 * a_shape[0] * a_shape[1] * b_shape[-1]  # 2D x 2D: the weight gradient


def _train_step_flops(model: nn.Module, tokens: torch.Tensor) -> int:
    """FLOPs of logits -> cross-entropy -> backward, math attention kernel forced."""
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
    return counter.get_total_flops()


def _shape_only_count(build_model: Callable[[], nn.Module], batch: int, seq: int,
                      meta: bool) -> float:
    """Nothing allocated. The meta device first: ~2.5x cheaper than fake tensors (no
    per-operator cache keys), which matters because every run counts on every rank; fake
    tensors where a model reads a value on the host (transformers' modules call `.item()`,
    which meta tensors refuse). bf16 parameters, so MoE experts take the grouped matmul
    (FLOPs do not depend on the dtype; the fp32 expert loop reads routing counts on the
    host)."""
    with torch.device("meta") if meta else FakeTensorMode(), default_dtype(torch.bfloat16):
        model = build_model()
        return float(_train_step_flops(model, torch.zeros(batch, seq, dtype=torch.long)))


def _probe_count(build_model: Callable[[], nn.Module], batch: int, seq: int) -> float:
    probe = min(seq, PROBE_TOKENS)
    model = build_model()
    return _train_step_flops(model, torch.zeros(1, probe, dtype=torch.long)) * batch * seq / probe


def count_step_flops(build_model: Callable[[], nn.Module], batch: int, seq: int) -> FlopCount:
    """Count on the meta device, else under fake tensors; if both fail, a small real probe
    scaled by tokens."""
    try:
        return FlopCount(_shape_only_count(build_model, batch, seq, meta=True), exact=True)
    except Exception:  # a model that reads values on the host: fake tensors can give them
        pass
    try:
        return FlopCount(_shape_only_count(build_model, batch, seq, meta=False), exact=True)
    except Exception as e:  # any failure of the fake run; the probe is the documented fallback
        logger.warning("FLOP count under fake tensors failed (%s: %s); using a %d-token real "
                       "probe scaled by tokens: attention is under-counted and MFU is a lower "
                       "bound", type(e).__name__, str(e).splitlines()[0][:200], PROBE_TOKENS)
    return FlopCount(_probe_count(build_model, batch, seq), exact=False)


def dtype_key(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "bf16"


def table_peak(device_name: str, dtype: torch.dtype) -> float | None:
    """Datasheet peak FLOP/s of a known accelerator (`loom.observability.devices`), else
    None (the CPU's is measured)."""
    known = known_device(device_name)
    return None if known is None else known.peak(dtype)


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


PEAK_CACHE = "peak_flops_v2.json"
"""Clean measurements only; older loom cached any measurement in peak_flops.json."""
MIN_CPU_SHARE = 0.9
"""A measurement is clean when the process's threads got a CPU for this share of the time
they were runnable."""
AGREEMENT = 0.1
"""...and its two best rounds agree within this fraction."""


@dataclass(frozen=True)
class PeakMeasurement:
    flops: float
    cpu_share: float
    """Share of its threads' runnable time the process spent on a CPU during the timed
    matmuls (see `cpu_share`)."""
    rounds: int
    clean: bool


def scheduler_times() -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable but waiting for one), summed over this process's
    threads, from /proc/self/task/*/schedstat; None where the kernel does not expose it."""
    on_cpu = waited = 0
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:  # a thread that ended between the listing and the read
            continue
        if len(fields) < 2:
            return None
        on_cpu, waited = on_cpu + int(fields[0]), waited + int(fields[1])
    return on_cpu / 1e9, waited / 1e9


def cpu_share(on_cpu: float, waited: float) -> float:
    """Share of the runnable time the threads spent on a CPU: 1.0 on an idle machine
    however many threads the kernel kept busy (an idle thread is neither on a CPU nor
    waiting), lower the longer other processes held the CPUs."""
    runnable = on_cpu + waited
    return on_cpu / runnable if runnable > 0 else 1.0


def fallback_share(cpu_seconds: float, wall: float, threads: int) -> float:
    """Without run-queue accounting (not Linux): CPU time over wall time x threads, which
    also reads a kernel that leaves threads idle as a busy machine."""
    return cpu_seconds / (wall * threads) if wall > 0 else 1.0


def timed_round(device: torch.device, dtype: torch.dtype, seconds: float) -> tuple[float, float]:
    """(best FLOP/s, CPU share) of square matmuls over a few sizes up to the plateau; a size
    whose one matmul takes longer than `seconds` (bf16 without hardware support) ends it."""
    sizes = (256, 512, 1024) if device.type == "cpu" else (4096, 8192)
    best, sync = 0.0, synchronizer(device)
    sched0, cpu0, wall0 = scheduler_times(), time.process_time(), time.perf_counter()
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        a @ b
        sync()
        deadline, reps, slowest = time.perf_counter() + seconds, 0, 0.0
        while reps < 2 or time.perf_counter() < deadline:
            start = time.perf_counter()
            a @ b
            sync()
            elapsed = time.perf_counter() - start
            best, slowest, reps = max(best, 2 * n**3 / elapsed), max(slowest, elapsed), reps + 1
        if slowest > seconds:
            break
    if device.type != "cpu":
        return best, 1.0
    sched1 = scheduler_times()
    if sched0 is not None and sched1 is not None:
        return best, cpu_share(sched1[0] - sched0[0], sched1[1] - sched0[1])
    return best, fallback_share(time.process_time() - cpu0, time.perf_counter() - wall0,
                                torch.get_num_threads())


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, seconds: float = 0.05,
                        max_rounds: int = 6) -> PeakMeasurement:
    """Best of several short rounds; stops early once the measurement is clean."""
    rounds: list[tuple[float, float]] = []
    while len(rounds) < max_rounds:
        rounds.append(timed_round(device, dtype, seconds))
        if len(rounds) >= 2 and is_clean(rounds):
            break
    best, share = max(rounds)
    return PeakMeasurement(best, share, len(rounds), is_clean(rounds))


def is_clean(rounds: list[tuple[float, float]]) -> bool:
    """The two best rounds agree and in neither did the threads wait long for a CPU."""
    (first, share1), (second, share2) = sorted(rounds, reverse=True)[:2]
    return second >= (1 - AGREEMENT) * first and min(share1, share2) >= MIN_CPU_SHARE


def peak_cache_key(device: torch.device, dtype: torch.dtype) -> str:
    return (f"{platform.node()}|{device_name(device)}|{dtype_key(dtype)}|"
            f"threads={torch.get_num_threads()}|torch={torch.__version__}")


def measured_peak(device: torch.device, dtype: torch.dtype, cache: Path, *,
                  remeasure: bool = False) -> float:
    """The matmul peak for this machine, dtype and thread count: cached if a clean
    measurement was ever taken, else measured now (and cached only if clean)."""
    path, key = cache / PEAK_CACHE, peak_cache_key(device, dtype)
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(key)
    if isinstance(entry, dict) and isinstance(entry.get("flops"), float) and not remeasure:
        return entry["flops"]
    peak = measure_matmul_peak(device, dtype)
    if not peak.clean:
        logger.warning("matmul peak measured on a busy machine (%.0f%% CPU share, %d rounds): "
                       "%.3g GFLOP/s, used for this run only, not cached", 100 * peak.cpu_share,
                       peak.rounds, peak.flops / 1e9)
        return peak.flops
    known[key] = {"flops": peak.flops, "cpu_share": round(peak.cpu_share, 3),
                  "rounds": peak.rounds, "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not cache the measured peak in %s: %s", path, e)
    return peak.flops


@dataclass(frozen=True)
class Peak:
    flops: float
    source: str
    """'datasheet' or 'measured'."""


def peak_flops(device: torch.device, dtype: torch.dtype, cache: Path, *,
               remeasure: bool = False) -> Peak:
    """Datasheet peak of a known accelerator; a measured matmul peak otherwise."""
    name = device_name(device)
    known = table_peak(name, dtype)
    if known is not None:
        return Peak(known, "datasheet")
    if device.type != "cpu" and not remeasure:
        logger.warning("no datasheet peak for %r; MFU uses a measured matmul peak", name)
    return Peak(measured_peak(device, dtype, cache, remeasure=remeasure), "measured")


class MfuMeter:
    """MFU of one rank's steps, never above 100%: the first reading above it re-measures
    the peak (`remeasure`, which bypasses the cache) and warns once; a reading that is
    still above 100% is reported as None, never as a number."""

    def __init__(self, flops_per_rank: float, peak: Peak, remeasure: Callable[[], Peak]):
        self.flops_per_rank, self.peak, self.remeasure = flops_per_rank, peak, remeasure
        self.warned = False

    def __call__(self, seconds: float) -> float | None:
        mfu = mfu_percent(self.flops_per_rank, seconds, self.peak.flops)
        if mfu > 100.0 and not self.warned:
            self.warned, old = True, self.peak
            if old.source == "measured":
                self.peak = self.remeasure()
            mfu = mfu_percent(self.flops_per_rank, seconds, self.peak.flops)
            logger.warning("MFU above 100%% against the %s peak %.4g TFLOP/s: %s; MFU "
                           "readings above 100%% are not reported", old.source,
                           old.flops / 1e12, f"re-measured {self.peak.flops / 1e12:.4g} "
                           "TFLOP/s" if old.source == "measured" else
                           "the FLOP count or the datasheet entry is wrong")
        return mfu if mfu <= 100.0 else None


def mfu_percent(flops_per_rank: float, seconds: float, peak: float) -> float:
    """Model FLOPs utilisation of one rank over one step, in percent of its peak."""
    return 100.0 * flops_per_rank / seconds / peak
