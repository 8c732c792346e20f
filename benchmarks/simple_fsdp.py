"""Step time and peak memory of FSDP2 vs SimpleFSDP, eager and compiled (inductor).

    python benchmarks/simple_fsdp.py                  # CPU: 2 gloo ranks, dp_shard 2, ~4 min cold
    python benchmarks/simple_fsdp.py --nproc 8 --model-flags "--model s --seq-len 2048"
                                                      # GPU: one rank per device, NCCL, bf16

Each configuration is a fresh job of --nproc ranks: one warm-up step (compilation happens
there), --timed-steps timed, then one step measured for memory. Rank 0 reports. Time is the
best timed step's wall time on CUDA (synchronised), and on the CPU the compute thread's CPU
time (wall time on a shared machine measures the neighbours). Peak memory is
`max_memory_allocated` above the pre-step level on CUDA; on the CPU, the most bytes live at
once in the profiler's allocation record of one step (benchmarks/memtrack.py).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.harness import free_port, rank_env

RESULTS = Path(__file__).parent / "results" / "simple_fsdp.json"
CPU_MODEL = ("--dim 256 --n-layers 4 --n-heads 8 --n-kv-heads 4 --multiple-of 256 "
             "--vocab-size 2048 --seq-len 512 --batch-size 2 --fp32")
CONFIGS = {
    "fsdp2 eager": [],
    "simple-fsdp eager": ["--data-parallel", "simple-fsdp"],
    "fsdp2 compiled": ["--compile"],
    "simple-fsdp compiled": ["--data-parallel", "simple-fsdp", "--compile"],
}


def timed_step(trainer, batch) -> tuple[float, float]:
    """(seconds, loss) of one training step."""
    cuda = trainer.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter() if cuda else time.thread_time()
    loss = trainer.train_step(batch).loss
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() if cuda else time.thread_time()) - start, loss.item()


def step_peak_bytes(trainer, batch) -> int:
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        trainer.train_step(batch)
        return torch.cuda.max_memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile

    from memtrack import peak_live_bytes

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.train_step(batch)
    return peak_live_bytes(prof)


def measure(name: str, model_flags: list[str], timed_steps: int) -> dict | None:
    """One rank of a configuration's job; rank 0 returns the result."""
    from loom.config import parse_args
    from rank_trainer import rank_trainer

    with tempfile.TemporaryDirectory() as outdir:
        cfg = parse_args([*model_flags, "--dataset", "random", "--seed", "0",
                          *CONFIGS[name], "--outdir", outdir])
        with rank_trainer(cfg, cpu_threads=1) as trainer:
            batches = iter(trainer.loader)
            start = time.perf_counter()
            trainer.train_step([next(batches)])
            warmup = time.perf_counter() - start
            times, losses = zip(*(timed_step(trainer, [next(batches)])
                                  for _ in range(timed_steps)), strict=True)
            peak = step_peak_bytes(trainer, [next(batches)])
    if trainer.info.rank != 0:
        return None
    return {"config": name, "flags": CONFIGS[name], "world_size": trainer.info.world_size,
            "device": trainer.device.type, "step_s": min(times), "warmup_s": warmup,
            "peak_bytes": peak, "losses": list(losses)}


def run_fresh(name: str, nproc: int, model_flags: str, timed_steps: int) -> dict:
    port = free_port()
    cmd = [sys.executable, __file__, "--worker", name, "--model-flags", model_flags,
           "--timed-steps", str(timed_steps)]
    procs = [subprocess.Popen(cmd, env=rank_env(r, nproc, port, None), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(nproc)]
    outputs = [p.communicate(timeout=900) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{name} failed:\n{outputs[0][1][-3000:]}")
    return json.loads(outputs[0][0].strip().splitlines()[-1])


def table(results: list[dict]) -> str:
    by_name = {r["config"]: r for r in results}
    lines = ["| configuration | step s | time / fsdp2 | peak MiB | peak / fsdp2 | warm-up s |",
             "| --- |" + " ---: |" * 5]
    for r in results:
        base = by_name.get(r["config"].replace("simple-fsdp", "fsdp2"), results[0])
        lines.append(f"| {r['config']} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} "
                     f"| {r['peak_bytes'] / 2**20:.0f} | "
                     f"{r['peak_bytes'] / base['peak_bytes']:.2f} | {r['warmup_s']:.1f} |")
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--nproc", type=int, default=2, help="ranks (one per GPU on CUDA)")
    parser.add_argument("--model-flags", default=CPU_MODEL, help="loom train flags of the model")
    parser.add_argument("--timed-steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse(argv)
    if args.worker:
        result = measure(args.worker, shlex.split(args.model_flags), args.timed_steps)
        if result is not None:
            print(json.dumps(result))
        return
    start = time.perf_counter()
    results = [run_fresh(name, args.nproc, args.model_flags, args.timed_steps)
               for name in args.configs]
    print(table(results))
    print(f"\n{time.perf_counter() - start:.0f} s in all; {args.nproc} ranks ({args.model_flags}); "
          f"best of {args.timed_steps} timed steps; ratios vs fsdp2 in the same mode")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
