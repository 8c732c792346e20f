"""Loss-stage time and peak memory of each --loss-impl at a large vocabulary, vs eager.

    python benchmarks/losses.py        # vocab 128,000 x 4,096 rows, 256,128 x 2,048; ~3 min

The loss stage is what a training step spends from the final hidden states (rows x dim) to
the gradients of the hidden states and of the output weight (vocab x dim): projection,
cross-entropy and their backward, in bf16 as under mixed precision. Each (mode, vocab) runs
in a fresh subprocess, so no allocator state or compiled code carries over.

Peak memory is torch's own accounting: every CPU allocation and free the profiler records
(`profile_memory`), summed in time order; the peak is the most bytes live at once above
what existed before the stage (hidden states, weight, labels). Unlike RSS it counts tensors
only, not freed pages glibc keeps or the compiler's heap, so modes compare on what they
allocate; the RSS high-water growth is reported alongside as a cross-check.

Time is the CPU time of one thread (`torch.set_num_threads(1)`, `time.thread_time`):
on a machine shared with other jobs, wall time measures the neighbours, while the thread's
CPU time (page faults included) measures the work. Wall time is recorded too. compiled
runs one untimed pass first, so compilation is not counted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from loom.losses import IGNORE_INDEX, fused_linear_cross_entropy, logits_criterion
from memtrack import peak_live_bytes, reset_rss_high_water, rss_high_water

MODES = ("eager", "chunked", "chunked-backward", "compiled", "fused-linear")
RESULTS = Path(__file__).parent / "results" / "losses.json"


def stage(mode: str, chunk_size: int):
    """(hidden, weight, labels) -> loss of the mode, projection included."""
    if mode == "fused-linear":
        return lambda h, w, y: fused_linear_cross_entropy(h, w, y, chunk_size)
    criterion = logits_criterion(mode, chunk_size)
    return lambda h, w, y: criterion(h @ w.T, y)


def one_pass(fn, hidden, weight, labels) -> tuple[float, float]:
    """(CPU seconds of this thread, wall seconds) of the loss forward and backward."""
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    cpu, wall = time.thread_time(), time.perf_counter()
    fn(h, w, labels).backward()
    return time.thread_time() - cpu, time.perf_counter() - wall


def measure(mode: str, rows: int, dim: int, vocab: int, chunk_size: int, passes: int) -> dict:
    """Run in the subprocess: time and peak memory of `passes` profiled passes."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, dim, generator=gen).bfloat16()
    weight = (torch.randn(vocab, dim, generator=gen) * dim**-0.5).bfloat16()
    labels = torch.randint(vocab, (rows,), generator=gen)
    labels[::16] = IGNORE_INDEX
    fn = stage(mode, chunk_size)
    if mode == "compiled":
        one_pass(fn, hidden, weight, labels)
    rss_before = reset_rss_high_water()
    times, peaks = [], []
    for _ in range(passes):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            times.append(one_pass(fn, hidden, weight, labels))
        peaks.append(peak_live_bytes(prof))
    return {"mode": mode, "vocab": vocab, "rows": rows, "dim": dim, "chunk_size": chunk_size,
            "cpu_s": min(t[0] for t in times), "wall_s": min(t[1] for t in times),
            "peak_bytes": max(peaks), "rss_growth_bytes": rss_high_water() - rss_before}


def run_fresh(args: argparse.Namespace, mode: str, vocab: int, rows: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", mode, "--shapes", f"{vocab}x{rows}",
           "--dim", str(args.dim), "--chunk-size", str(args.chunk_size),
           "--passes", str(args.passes)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> str:
    lines = ["| vocab | rows | mode | CPU s | time / eager | wall s | peak GiB | peak / eager "
             "| RSS growth GiB |", "|" + " ---: |" * 2 + " --- |" + " ---: |" * 6]
    eager = {r["vocab"]: r for r in results if r["mode"] == "eager"}
    for r in results:
        base = eager[r["vocab"]]
        lines.append(f"| {r['vocab']:,} | {r['rows']:,} | {r['mode']} | {r['cpu_s']:.2f} | "
                     f"{r['cpu_s'] / base['cpu_s']:.2f} | {r['wall_s']:.1f} | "
                     f"{r['peak_bytes'] / 2**30:.2f} | "
                     f"{r['peak_bytes'] / base['peak_bytes']:.2f} | "
                     f"{r['rss_growth_bytes'] / 2**30:.2f} |")
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["128000x4096", "256128x2048"],
                        help="VOCABxROWS of each configuration")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse(argv)
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes]
    if args.worker:
        (vocab, rows), = shapes
        print(json.dumps(measure(args.worker, rows, args.dim, vocab, args.chunk_size,
                                 args.passes)))
        return
    start = time.perf_counter()
    results = [run_fresh(args, mode, vocab, rows) for vocab, rows in shapes
               for mode in args.modes]
    print(table(results))
    print(f"\n{time.perf_counter() - start:.0f} s in all; dim {args.dim}, bf16 inputs, "
          f"row chunk {args.chunk_size}, 1 thread, best of {args.passes} pass(es); "
          "loss-parallel needs tp > 1 (at tp 1 it runs compiled)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
