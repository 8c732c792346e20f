"""What a profiler trace of a few training steps says without a viewer: how much of the
recorded steps' span the GPU ran no kernel (host-bound steps leave it idle), which
scaled-dot-product-attention implementation ran, and the kernels that took the most time.
Read as data (json), capped in size: a trace is the run's output, not trusted input."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

MAX_TRACE_BYTES = 2 * 2**30
SDPA_OP = re.compile(r"aten::_scaled_dot_product_(\w+?)_attention")
SDPA_KERNEL = re.compile(r"flash|fmha|cudnn.*attention|efficient_attention|attention_kernel",
                         re.I)


def merged_busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy


def summarise(path: Path) -> dict:
    if path.stat().st_size > MAX_TRACE_BYTES:
        return {"error": f"trace over {MAX_TRACE_BYTES} bytes"}
    events = json.loads(path.read_text()).get("traceEvents", [])
    number = (int, float)
    complete = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"
                and isinstance(e.get("ts"), number) and isinstance(e.get("dur"), number)]
    steps = [e for e in complete if str(e.get("name", "")).startswith("ProfilerStep#")]
    kernels = [e for e in complete if e.get("cat") == "kernel"]
    ops = Counter(m.group(1) for e in complete if e.get("cat") == "cpu_op"
                  for m in [SDPA_OP.match(str(e.get("name", "")))] if m)
    out: dict = {"steps": len(steps), "sdpa_ops": dict(ops),
                 "sdpa_kernels": sorted({str(e["name"])[:120] for e in kernels
                                         if SDPA_KERNEL.search(str(e["name"]))})[:8]}
    if steps:
        start = min(e["ts"] for e in steps)
        end = max(e["ts"] + e["dur"] for e in steps)
        out["span_ms"] = (end - start) / 1e3
    if kernels:
        k_start = min(e["ts"] for e in kernels)
        k_end = max(e["ts"] + e["dur"] for e in kernels)
        busy = merged_busy([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
        out.update(kernels=len(kernels), gpu_span_ms=(k_end - k_start) / 1e3,
                   gpu_busy_ms=busy / 1e3, gpu_idle_fraction=1 - busy / max(k_end - k_start, 1e-9))
        total: Counter = Counter()
        for e in kernels:
            total[str(e["name"])[:100]] += e["dur"]
        out["top_kernels_ms"] = {name: t / 1e3 for name, t in total.most_common(8)}
    else:
        out["gpu_idle_fraction"] = None
        out["note"] = "no GPU kernels in the trace (a CPU run)"
    return out
