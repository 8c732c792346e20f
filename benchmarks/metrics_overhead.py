"""Cost of per-step metrics: wall time per training step with metrics on versus off.

    python benchmarks/metrics_overhead.py [--steps 40] [--repeats 3] [--batch-size 4]

Each configuration trains in a fresh single-process `loom train` (a subprocess). The step
time is the interval between consecutive `train_step` calls, so it includes the metrics
work of the previous step (row, health statistics, jsonl, progress line); its median over
the steady steps is compared with `--no-metrics`, measured in the same run, configurations
interleaved over the repeats so that drifting machine load hits all alike. As a check that
does not depend on load, the time spent inside the metrics code itself (`log_step`, the
optimizer pre-hook, the forward mark) is also reported as a share of the training time. Writes
benchmarks/results/metrics_overhead.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "metrics_overhead.json"
MODEL = ["--model", "debug", "--dataset", "random", "--seq-len", "256", "--seed", "1"]
CONFIGS = {  # name: extra flags; the first is the baseline
    "metrics off": ["--no-metrics"],
    "metrics on (health every step)": ["--health-every", "1"],
    "metrics on (health every 10)": ["--health-every", "10"],
}
WARMUP = 5


def timed(fn: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)
    return wrapper


def worker(argv: list[str]) -> None:
    """Train in this process; print step start times and the time spent in metrics code."""
    from loom.config import parse_args
    from loom.observability import metrics
    from loom.runtime.distributed import rank_info
    from loom.runtime.logs import setup_logging
    from rank_trainer import rank_trainer

    inside: list[float] = []
    for name in ("log_step", "_before_update", "forward_done"):  # patched before watch()
        setattr(metrics.Metrics, name, timed(getattr(metrics.Metrics, name), inside))
    setup_logging(rank_info().rank)
    starts: list[float] = []
    with rank_trainer(parse_args(argv)) as trainer:
        step = trainer.train_step

        def record_start(batch: Any) -> Any:
            starts.append(time.perf_counter())
            return step(batch)

        trainer.train_step = record_start  # type: ignore[method-assign]
        trainer.fit()
    print("RESULT " + json.dumps({"starts": starts, "inside_s": sum(inside)}))


def run_config(flags: list[str], steps: int, outdir: Path) -> tuple[list[float], float]:
    """Steady step times (s) and the metrics code's share of the training time."""
    argv = [*MODEL, "--max-steps", str(steps), "--outdir", str(outdir), *flags]
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(argv)],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    starts = result["starts"]
    return ([b - a for a, b in itertools.pairwise(starts)][WARMUP:],
            result["inside_s"] / (starts[-1] - starts[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4, help="samples of 256 tokens")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.steps < WARMUP + 2:
        # the first WARMUP intervals are dropped; a median needs at least one steady one
        parser.error(f"--steps must be at least {WARMUP + 2} (the first {WARMUP} step "
                     "intervals are warm-up)")
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    shares: dict[str, list[float]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for i, (name, flags) in enumerate(CONFIGS.items()):
                flags = [*flags, "--batch-size", str(args.batch_size)]
                dts, share = run_config(flags, args.steps, Path(tmp) / f"{r}-{i}")
                times[name] += dts
                shares[name].append(share)
    medians = {name: statistics.median(dts) for name, dts in times.items()}
    share = {name: statistics.median(s) for name, s in shares.items()}
    base = medians[next(iter(CONFIGS))]
    print(f"{'configuration':<32} {'median step':>12} {'vs off':>7} {'in metrics code':>16}")
    for name, median in medians.items():
        print(f"{name:<32} {median * 1e3:>9.1f} ms {median / base:>7.3f} "
              f"{share[name] * 100:>15.2f}%")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "model_flags": [*MODEL, "--batch-size", str(args.batch_size)], "steps": args.steps,
        "repeats": args.repeats, "warmup": WARMUP,
        "median_step_s": medians, "ratio_to_off": {n: m / base for n, m in medians.items()},
        "share_in_metrics_code": share, "samples": {n: len(d) for n, d in times.items()}},
        indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
