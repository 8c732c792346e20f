"""How fast bad input fails: seconds from spawn until every rank has exited, against the
floor of starting the same number of Python processes that only import torch.

    python benchmarks/fail_fast.py [--repeats 3]        # ~1-2 min on 2 busy cores

The tests only bound these times loosely (hang limits); this is where the figure lives.
Cases: a config error on 4 ranks (`--tp 3`), a bad MoE config on 2 ranks, a too-large model
on 2 ranks (refused before allocation), a hub dataset on 1 rank without network (offline,
and a closed local port as the hub: no retry loop). Each repeat runs the baseline and every
case back to back, so machine-load drifts hit all alike. Writes benchmarks/results/fail_fast.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "fail_fast.json"
TRAIN = ["-m", "loom", "train", "--dataset", "random", "--fp32"]


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


HUB = ["-m", "loom", "train", "--model", "debug", "--dataset", "eliplutchok/fineweb-small-sample"]
CASES = {  # name: (ranks, argv after `python`, expected exit code, extra environment)
    "import torch (floor)": (4, ["-c", "import torch"], 0, {}),
    "--tp 3 on 4 ranks": (4, [*TRAIN, "--model", "debug", "--tp", "3"], 2, {}),
    "--ep 4 on 2 ranks": (2, [*TRAIN, "--model", "moe-debug", "--ep", "4"], 2, {}),
    "vocab 1e10 on 2 ranks": (2, [*TRAIN, "--model", "debug", "--vocab-size", "10000000000"], 2,
                              {}),
    "hub data, offline": (1, HUB, 2, {"HF_HUB_OFFLINE": "1"}),
    "hub data, closed port": (1, HUB, 2, {"HF_HUB_OFFLINE": "0",
                                         "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}),
}


def spawn(ranks: int, argv: list[str], outdir: Path, extra: dict[str, str]
          ) -> tuple[float, list[int]]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port(),
           "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), "OMP_NUM_THREADS": "1",
           "LOOM_CACHE_DIR": str(outdir.parent / "cache"), **extra}
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, *argv, *(["--outdir", str(outdir)]
                                                         if "loom" in argv else [])],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
             for r in range(ranks)]
    codes = [p.wait(timeout=600) for p in procs]
    return time.perf_counter() - start, codes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {name: [] for name in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for name, (ranks, argv, expected, extra) in CASES.items():
                elapsed, codes = spawn(ranks, argv, Path(tmp) / "run", extra)
                assert codes == [expected] * ranks, (name, codes)
                seconds[name].append(elapsed)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    floor = median["import torch (floor)"]
    print(f"{'case':<24} {'median s':>9} {'/ floor':>8}")
    for name, value in median.items():
        print(f"{name:<24} {value:>9.2f} {value / floor:>7.2f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"repeats": args.repeats, "load_average": os.getloadavg(),
                                   "median_s": median, "runs_s": seconds,
                                   "ratio_to_floor": {n: v / floor for n, v in median.items()}},
                                  indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
