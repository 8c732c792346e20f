"""One rank of a parity job: train several configurations in one process group, saving
rank 0's losses (in the run folder) and the final full parameters (params.pt) of each.
With `--grads`, also the full gradients of one more batch at the final weights (grads.pt);
with `--first-grads`, the full gradients of the first step's batch at the initial weights
(first-grads.pt; dense models only: an MoE forward would move its routing counts).

A run is its argv, or {"argv": [...], "routing": "record" | "<reference run folder>"}: an
MoE run that records its routers' picks, or replays a recorded run's (tests/routing.py)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from loom.config import parse_args
from loom.logs import setup_logging
from loom.mesh import ParallelDims
from loom.parallel.context import shard_batch
from loom.parallel.init import clean_name
from loom.runtime import init_distributed, rank_info, teardown
from loom.train import Trainer
from tests.routing import ROUTING_FILE, RoutingHooks


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {clean_name(n): full(p) for n, p in model.named_parameters()}


def whole_model(trainer: Trainer, value: Callable[[torch.Tensor], torch.Tensor],
                ) -> dict[str, torch.Tensor]:
    """`value(parameter)` in full for every parameter of the model, by its plain name; each
    pipeline stage's from the ranks that hold it."""
    mine = {clean_name(n): full(value(p)) for part in trainer.model_parts
            for n, p in part.named_parameters()}
    if not trainer.dims.pp_enabled:
        return mine
    stages: list[dict | None] = [None] * trainer.dims.pp
    dist.all_gather_object(stages, mine, group=trainer.dims.get_mesh("pp").get_group())
    return {name: t for stage in stages for name, t in stage.items()}


def batch_gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Gradients of the loader's first batch through the run's step executor, weighted and
    dp-averaged like a training step (each cp rank takes its shard of it); the model's
    gradients are cleared again."""
    batch = shard_batch(next(iter(trainer.loader)), trainer.dims)
    trainer.executor.forward_backward([batch], forward_done=lambda: None)
    grads = whole_model(trainer, lambda p: p.grad)
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads


def routing_hooks(trainer: Trainer, routing: str | None) -> RoutingHooks | None:
    """The run's routing hooks, installed, or None when it has no "routing" entry."""
    if routing is None:
        return None
    reference = None if routing == "record" else torch.load(f"{routing}/{ROUTING_FILE}")
    hooks = RoutingHooks(trainer.dims.dp_rank, reference)
    hooks.install(trainer.model_parts)
    return hooks


def main(runs: list[list[str] | dict], options: list[str]) -> None:
    info = rank_info()
    setup_logging(info.rank)
    device = init_distributed(info)
    try:
        for run in runs:
            torch._dynamo.reset()  # compiled blocks of an earlier run would be reused as-is
            argv, routing = (run, None) if isinstance(run, list) else (run["argv"],
                                                                      run["routing"])
            cfg = parse_args(argv)
            trainer = Trainer(cfg, info, ParallelDims.from_config(cfg.parallel, info.world_size),
                              device)
            hooks = routing_hooks(trainer, routing)
            saved = {}
            if "--first-grads" in options:
                saved["first-grads.pt"] = batch_gradients(trainer)
            try:
                trainer.fit()
            finally:
                trainer.close()
            saved["params.pt"] = whole_model(trainer, lambda p: p)
            if "--grads" in options:
                saved["grads.pt"] = batch_gradients(trainer)
            if hooks is not None:
                hooks.save(trainer.metrics.outdir, info.rank)
            if info.rank == 0:
                for name, tensors in saved.items():
                    torch.save(tensors, trainer.metrics.outdir / name)
    finally:
        teardown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2:])
