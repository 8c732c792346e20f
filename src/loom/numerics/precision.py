"""`--dtype auto|bf16|fp32`: resolved once per run, from the device the run got.

bf16 mixed precision pays only where the hardware computes in bf16: on CPUs without native
bf16 (AVX2-only x86) a bf16 matmul is 10-50x slower than fp32, so `auto` picks fp32 there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from loom.runtime.scope import GlobalSettings

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
"""/proc/cpuinfo flags of native bf16 arithmetic: x86 AVX512-BF16 / AMX, Arm BF16."""


@dataclass(frozen=True)
class Precision:
    requested: str
    dtype: str
    """'bf16' (bf16 parameters and compute, fp32 master weights) or 'fp32'."""
    reason: str


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key = line.split(":", 1)[0].strip()
        if key in ("flags", "Features"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_bf16_support() -> tuple[bool, str]:
    """(native bf16 arithmetic?, the evidence). oneDNN's check alone also accepts AVX512
    CPUs that only emulate bf16, so a native-bf16 CPU flag is required as well when
    /proc/cpuinfo is readable."""
    capability = torch.backends.cpu.get_cpu_capability()
    onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    flags = cpu_flags()
    native = sorted(set(BF16_CPU_FLAGS) & flags)
    supported = onednn and (bool(native) or not flags)
    evidence = (f"CPU capability {capability}, oneDNN bf16 {'yes' if onednn else 'no'}, "
                f"native bf16 flags {','.join(native) or 'none'}")
    return supported, evidence


def resolve_precision(requested: str, device: torch.device) -> Precision:
    """The concrete dtype for `requested` ('auto', 'bf16' or 'fp32') on `device`."""
    if requested != "auto":
        return Precision(requested, requested, f"--dtype {requested} given")
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return Precision("auto", "fp32", "auto: this CUDA device has no bf16 support")
    if device.type in ("cuda", "xpu"):
        return Precision("auto", "bf16", f"auto: {device.type} device computes in bf16")
    if device.type != "cpu":
        return Precision("auto", "fp32", f"auto: no bf16 fast path assumed on {device.type}")
    native, evidence = cpu_bf16_support()
    if native:
        return Precision("auto", "bf16", f"auto: CPU has native bf16 ({evidence})")
    return Precision("auto", "fp32", f"auto: CPU has no native bf16, where bf16 matmuls are 10-50x "
                     f"slower than fp32 ({evidence})")


def describe(dtype: str, reduce_dtype: str) -> str:
    """The wrapper log lines' precision phrase."""
    return "fp32" if dtype == "fp32" else f"bf16 params, {reduce_dtype} reduce"


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters built inside come out in `dtype` (torch's process-wide default, restored
    after)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def torch_dtype(dtype: str) -> torch.dtype:
    """Compute dtype of a resolved --dtype; 'auto' must have been resolved first."""
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not resolved; call resolve_precision first")
    return TORCH_DTYPES[dtype]


def matmul_settings(device_type: str) -> GlobalSettings:
    """TF32 for the fp32 matmuls a CUDA run still has (those autocast leaves in fp32, every
    one of a --fp32 run): several times the fp32 rate on tensor cores, at a 10-bit mantissa
    per product with fp32 accumulation, which training tolerates (torchtitan's default).
    Set for the run only, restored after; nothing elsewhere (CPUs have no TF32)."""
    return GlobalSettings(matmul_precision="high") if device_type == "cuda" \
        else GlobalSettings()
