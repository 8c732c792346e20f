"""One rank of a parity job: train several configurations in one process group, saving
rank 0's losses (in the run folder) and the final full parameters (params.pt) of each.
With `--grads`, also the full gradients of one more batch at the final weights (grads.pt);
with `--first-grads`, the full gradients of the first step's batch at the initial weights
(first-grads.pt; dense models only: an MoE forward would move its routing counts); with
`--shares`, how many elements of each stored parameter every rank holds (shares.json); with
`--initial`, the full parameters before the first step (initial.pt).

A run is its argv, or {"argv": [...], "routing": "record" | "<reference run folder>"}: an
MoE run that records its routers' picks, or replays a recorded run's (tests/routing.py); with
"merge": n, a reference that accumulated n forwards per step, replayed as one whole-batch
forward per step (`tests.routing.merged_forwards`)."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from loom.parallel.init import clean_name
from loom.trainer.parity import (
    batch_gradients,
    full,
    full_parameters,
    layout_training,
    whole_model,
)
from loom.trainer.trainer import Trainer
from tests.routing import ROUTING_FILE, RoutingHooks, merged_forwards
from tests.workers.bootstrap import rank_job

__all__ = ["full", "full_parameters"]  # other workers import them from here


def shares(trainer: Trainer) -> dict[str, list[int]]:
    """Per parameter, the element count of each rank's local shard, in rank order."""
    mine = {clean_name(n): (p.to_local() if isinstance(p, DTensor) else p).numel()
            for n, p in trainer.model.named_parameters()}
    ranks: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return {name: [r[name] for r in ranks] for name in mine}


def routing_hooks(trainer: Trainer, routing: str | None, merge: int = 1,
                  ) -> RoutingHooks | None:
    """The run's routing hooks, installed, or None when it has no "routing" entry."""
    if routing is None:
        return None
    reference = None if routing == "record" else torch.load(f"{routing}/{ROUTING_FILE}")
    if reference is not None and merge > 1:
        reference = merged_forwards(reference, merge)
    dims = trainer.dims
    cp = (dims.cp, dims.get_mesh("cp").get_local_rank()) if dims.cp_enabled else (1, 0)
    hooks = RoutingHooks(dims.dp_rank, reference, cp, trainer.cfg.data.seq_len)
    hooks.install(trainer.model_parts)
    return hooks


def main(runs: list[list[str] | dict], options: list[str]) -> None:
    with rank_job() as (info, device):
        for run in runs:
            run = {"argv": run} if isinstance(run, list) else run
            with layout_training(run["argv"], info, device) as trainer:
                hooks = routing_hooks(trainer, run.get("routing"), run.get("merge", 1))
                saved = {}
                if "--initial" in options:
                    saved["initial.pt"] = whole_model(trainer, lambda p: p.detach().clone())
                if "--shares" in options:
                    saved["shares.json"] = shares(trainer)
                if "--first-grads" in options:
                    saved["first-grads.pt"] = batch_gradients(trainer)
                trainer.fit()
                saved["params.pt"] = whole_model(trainer, lambda p: p)
                if "--grads" in options:
                    saved["grads.pt"] = batch_gradients(trainer)
                if hooks is not None:
                    hooks.save(trainer.metrics.outdir, info.rank)
                if info.rank == 0:
                    for name, value in saved.items():
                        path = trainer.metrics.outdir / name
                        if name.endswith(".json"):
                            path.write_text(json.dumps(value))
                        else:
                            torch.save(value, path)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2:])
