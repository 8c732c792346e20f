"""One rank of a LoRA job: train several configurations in one process group and save, on
rank 0, what each trained and what its optimizer holds (lora.json: names and global element
counts) beside its losses, and the final full parameters (params.pt)."""

from __future__ import annotations

import json
import sys

import torch

from loom.parallel.init import clean_name
from loom.trainer.parity import layout_training, whole_model
from tests.workers.bootstrap import rank_job


def main(runs: list[list[str]]) -> None:
    with rank_job() as (info, device):
        for argv in runs:
            with layout_training(argv, info, device) as trainer:
                named = [(clean_name(n), p) for n, p in trainer.model.named_parameters()]
                trainer.fit()
                names = {id(p): n for n, p in named}
                state = trainer.optimizer.state
                counts = {  # DTensor.numel() is the global size: the same on any mesh
                    "trainable": {n: p.numel() for n, p in named if p.requires_grad},
                    "total": sum(p.numel() for _, p in named),
                    "optimizer_params": sorted(names[id(p)] for g in trainer.optimizer.param_groups
                                               for p in g["params"]),
                    "optimizer_state": sum(t.numel() for s in state.values() for k, t in s.items()
                                           if k != "step" and isinstance(t, torch.Tensor)),
                }
                params = whole_model(trainer, lambda p: p)
                if info.rank == 0:
                    (trainer.metrics.outdir / "lora.json").write_text(json.dumps(counts))
                    torch.save(params, trainer.metrics.outdir / "params.pt")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
