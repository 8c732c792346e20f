"""Peak memory and step time of the memory knobs, vs the plain run (no AC, no compile).

    python benchmarks/knobs.py        # 5 configurations, fresh process each; ~3-4 min cold

Configurations: --ac none / selective / block, and --compile (inductor) with
--act-mem-budget 1.0 / 0.5. The model (dim 256, 4 blocks, 2 x 1,024 tokens, vocab 2,048,
fp32, one rank) is shaped so activations dominate: they outweigh parameters, gradients and
AdamW state several times over, which is where these knobs act.

Peak memory is torch's own accounting: every CPU allocation and free the profiler records
during one full training step (forward, backward, clip, AdamW), summed in time order; the
peak is the most bytes live at once above what existed before the step (parameters,
optimizer state). It counts tensors only -- not pages glibc keeps, nor the compiler's heap,
which a high-water RSS would also see -- so configurations compare on what they allocate.
The RSS high-water growth over the measured steps is reported alongside as a cross-check
(glibc's mmap threshold is pinned so freed tensors return to the OS).

Time is the CPU time of the one compute thread (`torch.set_num_threads(1)`) per step, best
of the timed steps: on a shared machine wall time measures the neighbours. Compilation
happens in the untimed warm-up step.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from memtrack import peak_live_bytes, reset_rss_high_water, rss_high_water

RESULTS = Path(__file__).parent / "results" / "knobs.json"
MODEL = ["--dim", "256", "--n-layers", "4", "--n-heads", "8", "--n-kv-heads", "4",
         "--multiple-of", "256", "--vocab-size", "2048", "--seq-len", "1024",
         "--batch-size", "2", "--fp32", "--dataset", "random", "--seed", "0"]
CONFIGS = {
    "none": [],
    "selective": ["--ac", "selective"],
    "block": ["--ac", "block"],
    "compile, budget 1.0": ["--compile", "--act-mem-budget", "1.0"],
    "compile, budget 0.5": ["--compile", "--act-mem-budget", "0.5"],
}


def measure(name: str, timed_steps: int) -> dict:
    """Run in the subprocess: one warm-up step, `timed_steps` timed, one profiled for memory."""
    from loom.config import parse_args
    from rank_trainer import rank_trainer

    with tempfile.TemporaryDirectory() as outdir:
        cfg = parse_args([*MODEL, *CONFIGS[name], "--outdir", outdir])
        with rank_trainer(cfg, cpu_threads=1) as trainer:  # the budget reaches the compiler
            batches = iter(trainer.loader)
            trainer.train_step([next(batches)])
            rss_before = reset_rss_high_water()
            times, losses = [], []
            for _ in range(timed_steps):
                start = time.thread_time()
                loss = trainer.train_step([next(batches)]).loss
                times.append(time.thread_time() - start)
                losses.append(loss.item())
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                trainer.train_step([next(batches)])
    n_params = sum(p.numel() for p in trainer.model.parameters())
    return {"config": name, "flags": CONFIGS[name], "params": n_params,
            "step_cpu_s": min(times), "peak_bytes": peak_live_bytes(prof),
            "rss_growth_bytes": rss_high_water() - rss_before, "losses": losses}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_fresh(name: str, timed_steps: int) -> dict:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    cmd = [sys.executable, __file__, "--worker", name, "--timed-steps", str(timed_steps)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {**result, "process_wall_s": time.perf_counter() - start}


def table(results: list[dict]) -> str:
    base = results[0]
    lines = ["| configuration | peak MiB | peak / none | RSS growth MiB | step CPU s "
             "| time / none |", "| --- |" + " ---: |" * 5]
    for r in results:
        lines.append(f"| {r['config']} | {r['peak_bytes'] / 2**20:.0f} | "
                     f"{r['peak_bytes'] / base['peak_bytes']:.2f} | "
                     f"{r['rss_growth_bytes'] / 2**20:.0f} | {r['step_cpu_s']:.2f} | "
                     f"{r['step_cpu_s'] / base['step_cpu_s']:.2f} |")
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                        help="the first is the baseline of the ratios")
    parser.add_argument("--timed-steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse(argv)
    if args.worker:
        print(json.dumps(measure(args.worker, args.timed_steps)))
        return
    start = time.perf_counter()
    results = [run_fresh(name, args.timed_steps) for name in args.configs]
    print(table(results))
    print(f"\n{time.perf_counter() - start:.0f} s in all; {results[0]['params'] / 1e6:.1f}M "
          f"parameters, fp32, 1 rank, 1 thread, best of {args.timed_steps} timed steps")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
