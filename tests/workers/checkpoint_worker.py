"""One rank of a checkpoint job: train several configurations in one process group; rank 0
saves the final full parameters (params.pt) and full optimizer state (optim.pt) of each."""

from __future__ import annotations

import json
import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from loom.config import parse_args
from loom.trainer.entry import run
from tests.workers.bootstrap import rank_job
from tests.workers.parity_worker import full_parameters


def main(runs: list[list[str]]) -> None:
    with rank_job() as (info, device):
        for argv in runs:
            trainer = run(parse_args(argv), info, device)
            params = full_parameters(trainer.model)
            optim = get_optimizer_state_dict(
                trainer.model, trainer.optimizer,
                options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if info.rank == 0:
                torch.save(params, trainer.metrics.outdir / "params.pt")
                torch.save(optim, trainer.metrics.outdir / "optim.pt")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
