"""One rank of a parity job: train several configurations in one process group, saving
rank 0's losses (in the run folder) and the final full parameters (params.pt) of each."""

from __future__ import annotations

import json
import sys

import torch
from torch.distributed.tensor import DTensor

from loom.cli import setup_logging
from loom.config import parse_args
from loom.parallel.init import clean_name
from loom.runtime import init_distributed, rank_info, teardown
from loom.train import run


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {clean_name(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
            for n, p in model.named_parameters()}


def main(runs: list[list[str]]) -> None:
    info = rank_info()
    setup_logging(info.rank)
    device = init_distributed(info)
    try:
        for argv in runs:
            trainer = run(parse_args(argv), info, device)
            params = full_parameters(trainer.model)
            if info.rank == 0:
                torch.save(params, trainer.writer.outdir / "params.pt")
    finally:
        teardown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
