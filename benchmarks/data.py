"""Pretraining-scale data: `loom tokenize` throughput and training start-up / peak RSS on a
small vs a large synthetic corpus, shards (memory-mapped) vs the old token cache.

    python benchmarks/data.py                 # 2 MB vs 20 MB of text (~5-10 min on 2 busy cores)
    python benchmarks/data.py --full          # 20 MB vs 400 MB (the issue's acceptance sizes)
    python benchmarks/data.py --sizes 20 100  # any other pair (results/data-20-100.json)
    python benchmarks/data.py --tokenize-only --sizes 20 200   # tokenize vs the plain loop
    python benchmarks/data.py --tokenize-only --sizes 20 --repeat 3  # best of 3, alternated

--tokenize-only: for each size, one .txt file (one document) and one .jsonl file of that
many MB, each tokenized by `loom tokenize -j <cpus>` and by a plain `tokenizers` loop (lines
read in batches of 1000, `encode_batch` on every core, token ids only: no files written),
side by side: tokens/s, their ratio, and the peak RSS of a `loom tokenize` worker
(results/data-tokenize-SIZES.json).

- tokenize: `loom tokenize` of the large corpus with -j 1 and -j 2 (MB/s, tokens/s);
- train: a fresh `loom train --model debug --fp32 --max-steps 2` process per row; start-up
  is summary.json's setup_s (the trainer's start to the first step), peak RSS the last
  metrics row's train/mem_rss_peak. "shards" trains on the `loom tokenize` output, "cache
  cold" on the jsonl through the old cache (tokenized inside the run), "cache warm" on the
  cache the cold run filled. Ratios are large / small, measured in the same run.
Writes benchmarks/results/data.json (other sizes than the default: data-SMALL-LARGE.json).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "data.json"
TRAIN = ["-m", "loom", "train", "--model", "debug", "--fp32", "--max-steps", "2",
         "--seq-len", "64", "--seed", "1", "--health-every", "0"]


def synthetic_jsonl(path: Path, megabytes: int, seed: int = 0) -> None:
    """Documents of 50-500 words drawn from a Zipf-like list of 5000 made-up words."""
    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(5000)]
    weights = [1 / (i + 1) for i in range(len(words))]
    pool = rng.choices(words, weights, k=200_000)
    target, written = megabytes * 2**20, 0
    with path.open("w") as f:
        while written < target:
            start = rng.randrange(len(pool) - 500)
            line = json.dumps({"text": " ".join(pool[start:start + rng.randint(50, 500)])})
            f.write(line + "\n")
            written += len(line) + 1


def synthetic_text(path: Path, megabytes: int, seed: int = 0) -> None:
    """The jsonl generator's documents as one text file: paragraphs between blank lines."""
    synthetic_jsonl(path.with_suffix(".tmp"), megabytes, seed)
    with path.with_suffix(".tmp").open() as f, path.open("w") as out:
        for line in f:
            out.write(json.loads(line)["text"] + ".\n\n")
    path.with_suffix(".tmp").unlink()


def plain_loop(path: Path) -> dict[str, float]:
    """The baseline: a plain `tokenizers` batch-encode loop over the file's lines."""
    from loom.data.tokenizers import load_shipped_tokenizer

    backend, jsonl = load_shipped_tokenizer().backend, path.suffix == ".jsonl"
    start, tokens, batch = time.perf_counter(), 0, []
    with path.open(encoding="utf-8") as f:
        for line in itertools.chain(f, [None]):
            if line is not None:
                batch.append(json.loads(line)["text"] if jsonl else line)
            if batch and (line is None or len(batch) == 1000):
                tokens += sum(len(e.ids) for e in backend.encode_batch(batch))
                batch = []
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def tokenize_vs_plain(sizes: list[int], work: Path, jobs: int, repeat: int) -> list[dict]:
    """One row per (size, format): `loom tokenize` and the plain loop on the same file,
    alternated `repeat` times; each keeps its fastest run (the least disturbed by other
    load on a shared machine)."""
    rows = []
    for size in sizes:
        for kind, make in (("txt", synthetic_text), ("jsonl", synthetic_jsonl)):
            path = work / f"corpus-{size}.{kind}"
            make(path, size)
            plains, looms = [], []
            for _ in range(repeat):
                plains.append(plain_loop(path))
                looms.append(tokenize(path, work / f"shards-{size}-{kind}", jobs))
                shutil.rmtree(work / f"shards-{size}-{kind}")
            path.unlink()
            plain = max(plains, key=lambda r: r["tokens_per_s"])
            loom = max(looms, key=lambda r: r["tokens_per_s"])
            rows.append({"mb": size, "format": kind, "jobs": jobs, "load_avg": os.getloadavg(),
                         "loom": loom, "plain": plain, "runs": repeat,
                         "speedup": loom["tokens_per_s"] / plain["tokens_per_s"]})
    return rows


def print_tokenize_table(rows: list[dict]) -> None:
    print(f"\n{'MB':>6} {'format':<6} {'-j':>3} {'loom tok/s':>11} {'plain tok/s':>12} "
          f"{'loom/plain':>10} {'worker peak RSS MB':>19}")
    for r in rows:
        print(f"{r['mb']:>6} {r['format']:<6} {r['jobs']:>3} {r['loom']['tokens_per_s']:>11,.0f} "
              f"{r['plain']['tokens_per_s']:>12,.0f} {r['speedup']:>10.2f} "
              f"{r['loom']['worker_peak_rss_mb']:>19,}")


def tokenize(src: Path, out: Path, jobs: int) -> dict[str, float]:
    from loom.commands.tokenize import tokenize as run

    shutil.rmtree(out, ignore_errors=True)
    manifest = run(str(src), out, jobs=jobs)
    return {"jobs": jobs, "mb": manifest["bytes"] / 2**20, "tokens": manifest["n_tokens"],
            **manifest["speed"]}


def train(dataset: Path, outdir: Path, cache: Path) -> dict[str, float]:
    env = {**os.environ, "LOOM_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, *TRAIN, "--dataset", str(dataset), "--outdir",
                          str(outdir)], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"loom train failed:\n{out.stderr[-2000:]}")
    summary = json.loads((outdir / "summary.json").read_text())
    last = json.loads((outdir / "metrics-0.jsonl").read_text().splitlines()[-1])
    return {"setup_s": summary["timings"]["setup_s"],
            "peak_rss_gib": last["train/mem_rss_peak"]}


def cpu_model() -> str:
    """lscpu's model name, from /proc/cpuinfo (empty where there is none)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="20 MB vs 400 MB")
    parser.add_argument("--sizes", type=int, nargs="+", metavar="MB",
                        help="MB of text of the two corpora, SMALL LARGE (default 2 20); "
                        "with --tokenize-only any number (default 20 200)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep files here")
    parser.add_argument("--tokenize-only", action="store_true",
                        help="only `loom tokenize` vs a plain tokenizers loop, per size")
    parser.add_argument("--repeat", type=int, default=1,
                        help="--tokenize-only: alternate the two this many times, keep the best")
    opts = parser.parse_args()
    if opts.tokenize_only:
        sizes = opts.sizes or (20, 200)
        work = opts.workdir or Path(tempfile.mkdtemp(prefix="loom-data-bench-"))
        work.mkdir(parents=True, exist_ok=True)
        rows = tokenize_vs_plain(list(sizes), work, os.cpu_count() or 1, opts.repeat)
        print_tokenize_table(rows)
        path = RESULTS.with_name(f"data-tokenize-{'-'.join(map(str, sizes))}.json")
        path.write_text(json.dumps({"cpus": os.cpu_count(), "cpu": cpu_model(),
                                    "rows": rows}, indent=2) + "\n")
        print(f"wrote {path}")
        return
    if opts.sizes and len(opts.sizes) != 2:
        parser.error("--sizes takes two sizes, SMALL LARGE (any number with --tokenize-only)")
    small_mb, large_mb = opts.sizes or ((20, 400) if opts.full else (2, 20))
    results_path = RESULTS if (small_mb, large_mb) == (2, 20) else \
        RESULTS.with_name(f"data-{small_mb}-{large_mb}.json")
    work = opts.workdir or Path(tempfile.mkdtemp(prefix="loom-data-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict = {"sizes_mb": [small_mb, large_mb], "cpus": os.cpu_count(),
                     "load_avg": os.getloadavg(), "tokenize": [], "train": []}
    for size in (small_mb, large_mb):
        synthetic_jsonl(work / f"text-{size}.jsonl", size)
    results["tokenize"] = [tokenize(work / f"text-{large_mb}.jsonl", work / f"shards-{large_mb}",
                                    jobs) for jobs in (1, 2)]
    tokenize(work / f"text-{small_mb}.jsonl", work / f"shards-{small_mb}", 2)
    for size in (small_mb, large_mb):
        cache = work / f"cache-{size}"
        shutil.rmtree(cache, ignore_errors=True)
        for kind, dataset in (("shards", work / f"shards-{size}"),
                              ("cache cold", work / f"text-{size}.jsonl"),
                              ("cache warm", work / f"text-{size}.jsonl")):
            row = train(dataset, work / f"run-{size}-{kind.replace(' ', '-')}", cache)
            results["train"].append({"mb": size, "kind": kind, **row})

    print(f"\nloom tokenize, {large_mb} MB of synthetic jsonl")
    print(f"{'-j':>3} {'seconds':>8} {'MB/s':>7} {'tokens/s':>12}")
    for r in results["tokenize"]:
        print(f"{r['jobs']:>3} {r['seconds']:>8.1f} {r['mb_per_s']:>7.2f} "
              f"{r['tokens_per_s']:>12,.0f}")
    print(f"\nloom train --model debug --max-steps 2: start-up and peak RSS, "
          f"{small_mb} MB vs {large_mb} MB")
    print(f"{'data':<11} {'MB':>4} {'setup s':>8} {'peak RSS GiB':>13}")
    for r in results["train"]:
        print(f"{r['kind']:<11} {r['mb']:>4} {r['setup_s']:>8.1f} {r['peak_rss_gib']:>13.3f}")
    ratios = {}
    for kind in ("shards", "cache cold", "cache warm"):
        small, large = (r for r in results["train"] if r["kind"] == kind)
        ratios[kind] = {"rss_large_over_small": large["peak_rss_gib"] / small["peak_rss_gib"],
                        "setup_large_over_small": large["setup_s"] / small["setup_s"]}
        print(f"{kind}: peak RSS x{ratios[kind]['rss_large_over_small']:.2f}, start-up "
              f"x{ratios[kind]['setup_large_over_small']:.2f} ({large_mb} MB / {small_mb} MB)")
    results["ratios"] = ratios
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {results_path}")
    if opts.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
