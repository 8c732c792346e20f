"""Step time and per-rank peak memory of pipeline parallel at pp 1, 2 and 4 and 1-8
micro-batches, at the same global batch, against the schedule's bubble in theory.

    python benchmarks/pipeline.py                     # CPU: debug model, batch 8, ~10 min
    python benchmarks/pipeline.py --pps 1 2 --microbatches 1 4

Each (pp, micro-batches) is a fresh job of pp ranks (dp 1, so the global batch is the
same): one warm-up step, --timed-steps timed, then one step measured for memory; every
rank reports. Peak memory is the most bytes live at once during one step above the
pre-step level (as in benchmarks/context_parallel.py). The bubble column is the schedule's
(pp - 1) / (micro-batches + pp - 1); a measured bubble needs idle, separate devices (on a
shared CPU, ranks' compute overlaps with their neighbours' waits), so it is not claimed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.harness import run_ranks

from context_parallel import random_data_trainer, step_times
from simple_fsdp import step_peak_bytes

RESULTS = Path(__file__).parent / "results" / "pipeline.json"
MODEL = "--model debug --vocab-size 2048 --seq-len 256 --batch-size 8 --fp32"


def measure(flags: list[str], timed_steps: int) -> dict:
    """One rank of a (pp, micro-batches) job: its step times, peak and pipeline layout."""
    with random_data_trainer(flags) as trainer:
        batches = iter(trainer.loader)
        trainer.train_step([next(batches)])
        walls, cpus, _ = zip(*(step_times(trainer, [next(batches)])
                               for _ in range(timed_steps)), strict=True)
        peak = step_peak_bytes(trainer, [next(batches)])
        layout = trainer.executor.layout().get("pipeline", {})
    return {"rank": trainer.info.rank, "pp": trainer.cfg.parallel.pp,
            "microbatches": layout.get("microbatches", 1),
            "bubble_theory": layout.get("bubble_theory", 0.0), "step_s": min(walls),
            "step_cpu_s": min(cpus), "peak_bytes": peak}


def run_job(pp: int, microbatches: int, model: str, timed_steps: int) -> list[dict]:
    flags = [*shlex.split(model), "--pp", str(pp), "--pp-schedule", "gpipe"]
    if pp > 1:
        flags += ["--pp-microbatches", str(microbatches)]
    job = run_ranks(pp, [__file__, "--worker", json.dumps(flags), "--timed-steps",
                         str(timed_steps)], timeout=3600)
    if not job.ok:
        raise RuntimeError(f"pp {pp} micro-batches {microbatches} failed:\n{job.describe()}")
    return [json.loads(r.stdout.strip().splitlines()[-1]) for r in job.ranks]


def table(jobs: list[list[dict]]) -> str:
    base = next(ranks for ranks in jobs if ranks[0]["pp"] == 1)
    lines = ["| pp | micro-batches | bubble (theory) | step s (wall) | step s (CPU, max rank) "
             "| peak MiB per rank | max peak / pp1 |", "|" + " ---: |" * 7]
    for ranks in jobs:
        peaks = [r["peak_bytes"] for r in ranks]
        lines.append(f"| {ranks[0]['pp']} | {ranks[0]['microbatches']} | "
                     f"{ranks[0]['bubble_theory']:.2f} | {max(r['step_s'] for r in ranks):.2f} | "
                     f"{max(r['step_cpu_s'] for r in ranks):.2f} | "
                     f"{' / '.join(f'{p / 2**20:.0f}' for p in peaks)} | "
                     f"{max(peaks) / base[0]['peak_bytes']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--model-flags", default=MODEL, help="loom train flags of the model")
    parser.add_argument("--timed-steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(json.loads(args.worker), args.timed_steps)))
        return
    start = time.perf_counter()
    jobs = [run_job(pp, m, args.model_flags, args.timed_steps) for pp in args.pps
            for m in (args.microbatches if pp > 1 else [1])]
    print(table(jobs))
    print(f"\n{time.perf_counter() - start:.0f} s in all; {args.model_flags}; gpipe; one rank "
          f"per stage (dp 1); best of {args.timed_steps} timed steps")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(jobs, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
