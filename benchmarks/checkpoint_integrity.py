"""Cost of sealing a checkpoint with a manifest of hashes, against the save it seals.

    python benchmarks/checkpoint_integrity.py [--dim 512 --n-layers 8 --repeats 3]

One process saves a loom Transformer and its AdamW state through DCP, alternating:
- "plain": DCP's own FileSystemWriter, no manifest (the baseline);
- "sealed": loom's writer (xxh3-64 of each data file computed while it is written) plus
  the manifest (small files hashed from the page cache), as `Checkpointer` does per rank;
- "crc32 / xxh3 read-back" (for reference): each hash of every file read back from the
  page cache after the plain save (an upper bound of hashing while writing);
- "digest" (for reference): `loom digest` of the sealed save (SHA-256 of every file, read
  back): what publishing or checking a checkpoint costs, once, outside training.
`--compare-with SRC` runs the same saves with another checkout's `src` (e.g. a
`git archive` of main) in a child process after each of this checkout's repeats, so the
two sealed saves are measured side by side (`sealed_ratio`: this one / the other).
The order alternates and each save's files are deleted before the next save, so neither
waits on the other's writeback.
Overheads are ratios to the plain save of the same run. Each rank hashes only the files it
wrote, so the ratio holds per rank at any world size. Writes
benchmarks/results/checkpoint_integrity.json.
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
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict

from loom.checkpoint.checkpointer import storage_writer
from loom.checkpoint.trust import file_record, write_manifest

try:
    from loom.checkpoint.digest import checkpoint_digest
except ImportError:  # a checkout from before `loom digest` (--compare-with)
    checkpoint_digest = None
from loom.models.llama.model import ModelArgs, Transformer

RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint_integrity.json"


def crc32_read_back(folder: Path) -> None:
    for path in folder.iterdir():
        crc = 0
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                crc = zlib.crc32(chunk, crc)


def xxh3_read_back(folder: Path) -> None:
    for path in folder.iterdir():
        file_record(path)


def save_plain(state: dict, folder: Path) -> None:
    dcp.save(state, storage_writer=FileSystemWriter(folder), no_dist=True)


def save_sealed(state: dict, folder: Path) -> None:
    writer = storage_writer(folder)
    dcp.save(state, storage_writer=writer, no_dist=True)
    write_manifest(folder, writer.fs.records, run_id="bench", step=0)


SAVES = {"plain": save_plain, "sealed": save_sealed}


def sealed_elsewhere(opts: argparse.Namespace) -> list[float]:
    """One sealed save timed by this script in a child process importing `--compare-with`'s
    loom."""
    argv = [sys.executable, __file__, "--only-sealed", "--repeats", "1", "--dim",
            str(opts.dim), "--n-layers", str(opts.n_layers), "--vocab-size",
            str(opts.vocab_size)]
    env = {**os.environ, "PYTHONPATH": str(opts.compare_with.resolve())}
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def timed(action: Callable, *args: object) -> float:
    start = time.perf_counter()
    action(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare-with", type=Path, metavar="SRC",
                        help="another checkout's src folder to time the sealed save of")
    parser.add_argument("--only-sealed", action="store_true",
                        help="(child of --compare-with) print the sealed saves' seconds")
    opts = parser.parse_args()
    model = Transformer(ModelArgs(dim=opts.dim, n_layers=opts.n_layers, n_heads=8,
                                  n_kv_heads=4, vocab_size=opts.vocab_size, multiple_of=256))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": {"state": optim_sd["state"]}}
    times: dict[str, list[float]] = {"plain": [], "sealed": [], "crc32": [], "xxh3": [],
                                     "digest": []}
    size = 0
    with tempfile.TemporaryDirectory() as root:  # untimed: a fresh process's first save
        save_sealed(state, Path(root) / "warm-up")  # pays for first-touch page faults
    if opts.only_sealed:
        with tempfile.TemporaryDirectory() as root:
            seconds = []
            for _ in range(opts.repeats):
                seconds.append(timed(save_sealed, state, Path(root) / "sealed"))
                shutil.rmtree(Path(root) / "sealed")
        print(json.dumps(seconds))
        return
    if opts.compare_with:
        times["sealed_other"] = []
    with tempfile.TemporaryDirectory() as root:
        for i in range(opts.repeats):  # alternate the order; each save's files deleted at once
            if opts.compare_with and i % 2 == 0:  # before this checkout's saves, then after
                times["sealed_other"] += sealed_elsewhere(opts)
            for kind in ("plain", "sealed") if i % 2 == 0 else ("sealed", "plain"):
                folder = Path(root) / kind
                times[kind].append(timed(SAVES[kind], state, folder))
                if kind == "plain":
                    times["crc32"].append(timed(crc32_read_back, folder))
                    times["xxh3"].append(timed(xxh3_read_back, folder))
                    size = sum(p.stat().st_size for p in folder.iterdir())
                elif checkpoint_digest is not None:
                    times["digest"].append(timed(checkpoint_digest, folder))
                shutil.rmtree(folder)
            if opts.compare_with and i % 2 == 1:
                times["sealed_other"] += sealed_elsewhere(opts)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    result = {"params_m": sum(p.numel() for p in model.parameters()) / 1e6,
              "checkpoint_mb": size / 1e6, "repeats": opts.repeats, "median_s": med,
              "all_s": times,
              "sealed_overhead_percent": 100 * (med["sealed"] / med["plain"] - 1),
              "crc32_read_back_percent": 100 * med["crc32"] / med["plain"],
              "xxh3_read_back_percent": 100 * med["xxh3"] / med["plain"]}
    if "sealed_other" in med:
        result["compared_with"] = str(opts.compare_with)
        result["sealed_ratio"] = med["sealed"] / med["sealed_other"]
        print(f"sealed save here {med['sealed']:.3f} s, with {opts.compare_with} "
              f"{med['sealed_other']:.3f} s: ratio {result['sealed_ratio']:.3f}")
    if "digest" in med:
        print(f"loom digest (SHA-256 read-back, outside training): {med['digest']:.3f} s")
    print(f"{'params (M)':>11} {'ckpt (MB)':>10} {'plain s':>8} {'sealed s':>9} "
          f"{'overhead':>9} {'crc32 read-back':>16} {'xxh3 read-back':>15}")
    print(f"{result['params_m']:>11.1f} {result['checkpoint_mb']:>10.1f} {med['plain']:>8.3f} "
          f"{med['sealed']:>9.3f} {result['sealed_overhead_percent']:>8.1f}% "
          f"{result['crc32_read_back_percent']:>15.1f}% "
          f"{result['xxh3_read_back_percent']:>14.1f}%")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
