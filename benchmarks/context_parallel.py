"""Per-rank peak memory and step time of context parallel at cp 1, 2 and 4, long sequences.

    python benchmarks/context_parallel.py          # CPU: seq 4096 and 8192, ~10 min on 2 cores
    python benchmarks/context_parallel.py --seq-lens 8192 --cps 1 2

Each (seq, cp) is a fresh job of cp ranks (dp 1, so the global batch is the same): one
warm-up step, --timed-steps timed, then one step measured for memory; rank 0 reports.
Peak memory is the most bytes live at once during one step, above the pre-step level
(the profiler's allocation record on the CPU, `max_memory_allocated` on CUDA), plus the
process's RSS high-water mark. Step time is the best step's wall time and, on the CPU,
the compute thread's CPU time (wall time on a shared machine also measures neighbours).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.harness import run_ranks

from memtrack import rss_high_water
from simple_fsdp import step_peak_bytes

RESULTS = Path(__file__).parent / "results" / "context_parallel.json"
MODEL = "--model debug --vocab-size 2048 --batch-size 1 --fp32"


def step_times(trainer, batch) -> tuple[float, float, float]:
    """(wall seconds, compute-thread CPU seconds, loss) of one training step."""
    cuda = trainer.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.thread_time()
    loss = trainer.train_step(batch).loss
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - wall, time.thread_time() - cpu, loss.item()


@contextmanager
def random_data_trainer(flags: list[str]) -> Iterator:
    """This rank's Trainer for `flags` on random data in a throwaway run folder (one compute
    thread per CPU rank); the process group is torn down afterwards."""
    from loom.config import parse_args
    from rank_trainer import rank_trainer

    with tempfile.TemporaryDirectory() as outdir:
        cfg = parse_args([*flags, "--dataset", "random", "--seed", "0", "--outdir", outdir])
        with rank_trainer(cfg, cpu_threads=1) as trainer:
            yield trainer


def measure(flags: list[str], timed_steps: int) -> dict | None:
    """One rank of a (seq, cp) job; rank 0 returns the result."""
    with random_data_trainer(flags) as trainer:
        batches = iter(trainer.loader)
        start = time.perf_counter()
        trainer.train_step([next(batches)])
        warmup = time.perf_counter() - start
        walls, cpus, losses = zip(*(step_times(trainer, [next(batches)])
                                    for _ in range(timed_steps)), strict=True)
        peak = step_peak_bytes(trainer, [next(batches)])
    if trainer.info.rank != 0:
        return None
    cfg = trainer.cfg
    return {"seq_len": cfg.data.seq_len, "cp": cfg.parallel.cp, "flags": flags,
            "device": trainer.device.type, "step_s": min(walls), "step_cpu_s": min(cpus),
            "warmup_s": warmup, "peak_bytes": peak, "rss_peak_bytes": rss_high_water(),
            "losses": list(losses)}


def run_job(seq: int, cp: int, model: str, timed_steps: int) -> dict:
    flags = [*shlex.split(model), "--seq-len", str(seq), "--cp", str(cp)]
    job = run_ranks(cp, [__file__, "--worker", json.dumps(flags), "--timed-steps",
                         str(timed_steps)], timeout=3600)
    if not job.ok:
        raise RuntimeError(f"seq {seq} cp {cp} failed:\n{job.describe()}")
    return json.loads(job.ranks[0].stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> str:
    base = {r["seq_len"]: r for r in results if r["cp"] == 1}
    lines = ["| seq | cp | step peak MiB | peak / cp1 | RSS peak MiB | step s (wall) "
             "| step s (CPU) | CPU time / cp1 |", "|" + " ---: |" * 8]
    for r in results:
        b = base.get(r["seq_len"], r)
        lines.append(f"| {r['seq_len']} | {r['cp']} | {r['peak_bytes'] / 2**20:.0f} | "
                     f"{r['peak_bytes'] / b['peak_bytes']:.2f} | "
                     f"{r['rss_peak_bytes'] / 2**20:.0f} | {r['step_s']:.2f} | "
                     f"{r['step_cpu_s']:.2f} | {r['step_cpu_s'] / b['step_cpu_s']:.2f} |")
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--model-flags", default=MODEL, help="loom train flags of the model")
    parser.add_argument("--timed-steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse(argv)
    if args.worker:
        result = measure(json.loads(args.worker), args.timed_steps)
        if result is not None:
            print(json.dumps(result))
        return
    start = time.perf_counter()
    results = [run_job(seq, cp, args.model_flags, args.timed_steps)
               for seq in args.seq_lens for cp in args.cps]
    print(table(results))
    print(f"\n{time.perf_counter() - start:.0f} s in all; {args.model_flags}; one rank per cp "
          f"degree (dp 1); best of {args.timed_steps} timed steps; ratios vs cp 1 at the same "
          "sequence length")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
