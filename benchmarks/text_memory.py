"""Peak memory of `loom train` on one .txt document with no line break, against a small file.

    python benchmarks/text_memory.py [--mb 10 50] [--src PATH]   # minutes: 50 MB is tokenized

Each row is a fresh `loom train --model debug --dataset F --max-steps 1` (offline, an empty
token cache, so the file is tokenized) in a process of its own, whose peak RSS is read from
`getrusage(RUSAGE_CHILDREN)` by a parent that runs only it. The document is words and
punctuation separated by spaces, never a line break. `--src` runs another checkout's
`src/` (a before/after comparison). Writes benchmarks/results/text_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "text_memory.json"
SRC = Path(__file__).resolve().parents[1] / "src"
FLAGS = ["--model", "debug", "--max-steps", "1", "--seq-len", "32", "--batch-size", "2"]
PEAK = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, code)")


def one_line_document(path: Path, mb: float) -> None:
    """`mb` MB of words separated by spaces (a comma now and then), no line break."""
    rng = random.Random(0)
    words = [f"w{rng.randrange(5000)}{',' if rng.random() < 0.1 else ''}" for _ in range(4096)]
    block = " ".join(words) + " "
    with path.open("w") as f:
        for _ in range(int(mb * 2**20) // len(block) + 1):
            f.write(block)


def peak_rss_mb(dataset: Path, src: Path, tmp: Path) -> tuple[float, float]:
    """(peak RSS in MiB, seconds) of one `loom train` on `dataset`."""
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1",
           "LOOM_CACHE_DIR": tempfile.mkdtemp(dir=tmp)}
    argv = [sys.executable, "-m", "loom", "train", *FLAGS, "--dataset", str(dataset),
            "--outdir", tempfile.mkdtemp(dir=tmp)]
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PEAK, *argv], env=env, capture_output=True,
                         text=True, check=True)
    peak_kb, code = out.stdout.split()[-2:]
    if code != "0":
        raise SystemExit(f"loom train on {dataset} exited {code}:\n{out.stderr[-2000:]}")
    return int(peak_kb) / 1024, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[10, 50])
    parser.add_argument("--src", type=Path, default=SRC, help="the src/ folder to run")
    parser.add_argument("--label", default="this checkout")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        for mb in [0.01, *args.mb]:
            doc = tmp / f"one-line-{mb:g}MB.txt"
            one_line_document(doc, mb)
            peak, seconds = peak_rss_mb(doc, args.src, tmp)
            rows.append({"mb": mb, "peak_rss_mib": round(peak), "seconds": round(seconds, 1)})
            print(f"{args.label}: {mb:>6g} MB one line: peak RSS {peak:8.0f} MiB "
                  f"({seconds:.0f} s)", flush=True)
    small = rows[0]["peak_rss_mib"]
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    results[args.label] = {"flags": FLAGS, "cpu": os.cpu_count(),
                           "load_average": os.getloadavg(), "rows": rows,
                           "above_small_mib": {r["mb"]: r["peak_rss_mib"] - small
                                               for r in rows[1:]}}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
