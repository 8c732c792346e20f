"""The device and its bf16 matmul rate, measured in the same run as the rows: the second
MFU denominator (the datasheet's is the first). Random data (zeros run faster on an H200),
a fresh input pair per timed product so no product reads another's operands from L2.

    python3 benchmarks/devcheck/matmul.py N     # prints one JSON line
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time

import torch


def rate(n: int, device: torch.device, repeats: int = 10) -> float:
    """Median TFLOP/s of an n x n x n bf16 product."""
    pairs = [(torch.randn(n, n, device=device, dtype=torch.bfloat16),
              torch.randn(n, n, device=device, dtype=torch.bfloat16)) for _ in range(4)]
    for a, b in pairs[:3]:  # warm-up: handles, kernel selection, clocks
        a @ b
    times = []
    for i in range(repeats):
        a, b = pairs[i % len(pairs)]
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e12


def main() -> int:
    n = int(sys.argv[1])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    info = {"torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda, "matmul_n": n}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, memory_bytes=props.total_memory,
                    capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count)
    else:
        info.update(device="cpu")
    info["matmul_tflops"] = rate(n, device)
    print(json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
