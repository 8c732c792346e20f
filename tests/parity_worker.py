"""One rank of a parity job: train several configurations in one process group, saving
rank 0's losses (in the run folder) and the final full parameters (params.pt) of each;
with `--grads`, also the full gradients of one more batch at the final weights (grads.pt)."""

from __future__ import annotations

import json
import sys

import torch
from torch.distributed.tensor import DTensor

from loom.cli import setup_logging
from loom.config import parse_args
from loom.parallel.init import clean_name
from loom.runtime import init_distributed, rank_info, teardown
from loom.train import Trainer, run


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {clean_name(n): full(p) for n, p in model.named_parameters()}


def batch_gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Gradients of the loader's first batch under the run's loss, dp-averaged by FSDP like a
    training step."""
    batch = next(iter(trainer.loader))
    inputs, labels = batch["input"].to(trainer.device), batch["labels"].to(trainer.device)
    trainer.loss_fn(trainer.model, inputs, labels).backward()
    return {clean_name(n): full(p.grad) for n, p in trainer.model.named_parameters()}


def main(runs: list[list[str]], grads: bool = False) -> None:
    info = rank_info()
    setup_logging(info.rank)
    device = init_distributed(info)
    try:
        for argv in runs:
            torch._dynamo.reset()  # compiled blocks of an earlier run would be reused as-is
            trainer = run(parse_args(argv), info, device)
            params = full_parameters(trainer.model)
            gradients = batch_gradients(trainer) if grads else None
            if info.rank == 0:
                torch.save(params, trainer.metrics.outdir / "params.pt")
                if gradients is not None:
                    torch.save(gradients, trainer.metrics.outdir / "grads.pt")
    finally:
        teardown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), grads="--grads" in sys.argv[2:])
