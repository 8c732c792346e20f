"""One rank of the data job: build the dataset through the real path (local rank 0
tokenizes, the others read the cache), then record this rank's first batches, its mesh
coordinates and whether it ever imported `datasets`."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from loom.config import parse_args
from loom.config.resolved import applied
from loom.data.loaders import build_dataloader, build_dataset
from loom.parallel.mesh import ParallelDims
from tests.workers.bootstrap import rank_job

STEPS, BATCH, SEED = 4, 2, 3


def first_batches(dataset, batch: int, dp_rank: int, dp_size: int) -> list[torch.Tensor]:
    loader = build_dataloader(dataset, batch_size=batch, dp_rank=dp_rank, dp_size=dp_size,
                              seed=SEED, num_workers=0)
    loader.sampler.set_epoch(1)
    return [b["input"] for _, b in zip(range(STEPS), loader, strict=False)]


def main(source: str, outdir: Path) -> None:
    with rank_job() as (info, _):
        cfg = parse_args(["--model", "debug", "--tp", "2", "--dataset", source, "--seq-len", "16",
                          "--seed", str(SEED)])
        dims = ParallelDims(1, -1, 2, info.world_size)
        dims.build_mesh("cpu")
        dataset, facts = build_dataset(cfg, info.local_rank)
        cfg = applied(cfg, facts)
        record = {"dp_rank": dims.dp_rank, "tp_rank": dims.get_mesh("tp").get_local_rank(),
                  "batches": first_batches(dataset, BATCH, dims.dp_rank, dims.dp_size),
                  "one_process": first_batches(dataset, BATCH * dims.dp_size, 0, 1),
                  "imported_datasets": "datasets" in sys.modules,
                  "vocab_size": cfg.model.vocab_size}
        torch.save(record, outdir / f"rank{info.rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
