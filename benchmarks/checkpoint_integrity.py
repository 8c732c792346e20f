"""Cost of sealing a checkpoint with a crc32 manifest, against the save it seals.

    python benchmarks/checkpoint_integrity.py [--dim 512 --n-layers 8 --repeats 3]

One process saves a loom Transformer and its AdamW state through DCP (as `Checkpointer`
does), then writes the manifest of the same folder (sizes + zlib.crc32 of every file, read
back from the page cache as in a real save). Repeats alternate so load drift hits both.
The ratio manifest / save is the overhead; the issue asks for <= 5 %. Writes
benchmarks/results/checkpoint_integrity.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from loom.checkpoint_trust import write_manifest
from loom.models.llama import ModelArgs, Transformer

RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint_integrity.json"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    model = Transformer(ModelArgs(dim=opts.dim, n_layers=opts.n_layers, n_heads=8,
                                  n_kv_heads=4, vocab_size=opts.vocab_size, multiple_of=256))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": {"state": optim_sd["state"]}}
    save_s, manifest_s, size = [], [], 0
    with tempfile.TemporaryDirectory() as root:
        for i in range(opts.repeats):
            folder = Path(root) / f"step-{i}"
            start = time.perf_counter()
            dcp.save(state, checkpoint_id=folder, no_dist=True)
            save_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            write_manifest(folder, run_id="bench", step=i)
            manifest_s.append(time.perf_counter() - start)
            size = sum(p.stat().st_size for p in folder.iterdir())
            shutil.rmtree(folder)
    save, manifest = statistics.median(save_s), statistics.median(manifest_s)
    result = {"params_m": sum(p.numel() for p in model.parameters()) / 1e6,
              "checkpoint_mb": size / 1e6, "save_s": save, "manifest_s": manifest,
              "overhead_percent": 100 * manifest / save, "repeats": opts.repeats,
              "save_s_all": save_s, "manifest_s_all": manifest_s}
    print(f"{'params (M)':>11} {'ckpt (MB)':>10} {'save s':>8} {'manifest s':>11} "
          f"{'overhead':>9}")
    print(f"{result['params_m']:>11.1f} {result['checkpoint_mb']:>10.1f} {save:>8.3f} "
          f"{manifest:>11.3f} {result['overhead_percent']:>8.2f}%")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
