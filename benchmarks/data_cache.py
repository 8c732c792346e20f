"""Start-up time on the full embedded corpus with a cold vs a warm token cache.

    python benchmarks/data_cache.py [--repeats 3]        # ~2-4 min on 2 busy cores

Every start is a fresh process (offline), timed from spawn until it is ready:
- "train": `loom train --model debug` until the trainer is built and step 1 could run
  (interpreter, torch, process group, data, model); the data step is also timed alone;
- "data": only the dataset (interpreter, torch, `loom.data`, tokenize or memory-map).
"cold" starts on an empty cache folder, "warm" on the folder the cold start just filled;
they alternate over the repeats so machine-load drifts hit both alike. Speed-ups are
cold / warm, in the same run. Writes benchmarks/results/data_cache.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "data_cache.json"
FLAGS = ["--model", "debug", "--max-steps", "1", "--seed", "1"]
SCOPES = ("train", "data")


def worker_train(argv: list[str]) -> dict[str, float]:
    from loom.config import parse_args
    from loom.trainer import resolve
    from rank_trainer import rank_trainer

    build_datasets, data_s = resolve.build_datasets, []

    def timed_build(*args, **kwargs):
        start = time.perf_counter()
        out = build_datasets(*args, **kwargs)
        data_s.append(time.perf_counter() - start)
        return out

    resolve.build_datasets = timed_build
    with rank_trainer(parse_args(argv)):
        ready = time.time()
    return {"ready": ready, "data_s": data_s[0]}


def worker_data(argv: list[str]) -> dict[str, float]:
    import torch.distributed as dist

    from loom.config import parse_args
    from loom.data.loaders import build_dataset

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    start = time.perf_counter()
    dataset, _ = build_dataset(parse_args(argv), local_rank=0)
    ready = time.time()
    assert len(dataset) > 0
    dist.destroy_process_group()
    return {"ready": ready, "data_s": time.perf_counter() - start}


def start_once(scope: str, cache: Path, outdir: Path) -> dict[str, float]:
    env = {**os.environ, "LOOM_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    argv = json.dumps([*FLAGS, "--outdir", str(outdir)])
    spawn = time.time()
    out = subprocess.run([sys.executable, __file__, "--worker", scope, argv],
                         capture_output=True, text=True, check=True, env=env)
    marks = json.loads(next(x for x in out.stdout.splitlines()
                            if x.startswith("MARKS "))[len("MARKS "):])
    return {"startup_s": marks["ready"] - spawn, "data_s": marks["data_s"]}


def measure(repeats: int) -> dict[str, dict[str, list[dict[str, float]]]]:
    runs = {scope: {"cold": [], "warm": []} for scope in SCOPES}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        for r in range(repeats):
            for scope in SCOPES:
                shutil.rmtree(cache, ignore_errors=True)
                for state in ("cold", "warm"):
                    outdir = Path(tmp) / f"{r}-{state}"  # a fresh run folder for each start
                    runs[scope][state].append(start_once(scope, cache, outdir))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        scope, argv = args.worker
        marks = (worker_train if scope == "train" else worker_data)(json.loads(argv))
        print("MARKS " + json.dumps(marks))
        return
    runs = measure(args.repeats)
    medians = {scope: {state: {key: statistics.median(run[key] for run in rs) for key in rs[0]}
                       for state, rs in states.items()} for scope, states in runs.items()}
    speedups = {scope: {key: m["cold"][key] / m["warm"][key] for key in m["cold"]}
                for scope, m in medians.items()}
    print(f"{'scope':<6} {'cold start':>11} {'warm start':>11} {'speed-up':>9} "
          f"{'cold data':>10} {'warm data':>10} {'speed-up':>9}")
    for scope, m in medians.items():
        c, w, s = m["cold"], m["warm"], speedups[scope]
        print(f"{scope:<6} {c['startup_s']:>9.2f} s {w['startup_s']:>9.2f} s "
              f"{s['startup_s']:>8.2f}x {c['data_s']:>8.2f} s {w['data_s']:>8.3f} s "
              f"{s['data_s']:>8.0f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"flags": FLAGS, "repeats": args.repeats,
                                   "load_average": os.getloadavg(), "median": medians,
                                   "speedup": speedups, "runs": runs}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
