"""One rank of the HF loading test: train each run in one process group through loom's
loadings (rank 0 streams each rank its slices, or rank 0 loads the whole model and
broadcasts it) and through the old one (every rank reads it), saving rank 0's losses and the
initial full weights and buffers (initial.pt). On ranks other than 0, loom's loadings may
not read the checkpoint; the streaming one may not load the whole model on any rank."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import loom.hf.load as hf_load
import loom.trainer.model_parts as model_parts
from loom.config import ConfigError, ModelConfig, parse_args
from loom.models.transformers.model import HFCausalLM, load_hf_model
from loom.parallel.parallelize import parallelize
from loom.trainer.scoped import training
from tests.workers.bootstrap import rank_job
from tests.workers.parity_worker import full

LOADERS = {"stream": hf_load.build_hf_model, "whole-model": hf_load.build_hf_model,
           "every-rank": lambda cfg, dims, device, backend: parallelize(
               load_hf_model(cfg.model), dims, cfg.parallel, loss_parallel=False,
               backend=backend)}


def refuse_to_read(m: ModelConfig, *args: object) -> HFCausalLM:
    raise ConfigError(f"rank {dist.get_rank()} read the checkpoint {m.model}")


def never_streamable(m: ModelConfig, model: torch.nn.Module) -> None:
    return None


SAFETENSORS_FILES = hf_load.safetensors_files


def set_up_loader(loader: str, rank: int) -> None:
    """Which reads this loader's path may make on this rank."""
    hf_load.load_hf_model = refuse_to_read if loader == "stream" or rank != 0 \
        else load_hf_model
    hf_load.safetensors_files = refuse_to_read if rank != 0 else \
        never_streamable if loader == "whole-model" else SAFETENSORS_FILES


def initial_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (rotary frequencies too), gathered in full."""
    return {**{n: full(p) for n, p in model.named_parameters()},
            **{n: full(b) for n, b in model.named_buffers()}}


def main(runs: list[tuple[str, list[str]]]) -> None:
    with rank_job() as (info, device):
        for loader, argv in runs:
            set_up_loader(loader, info.rank)
            model_parts.build_hf_model = LOADERS[loader]
            cfg = parse_args(argv)
            with training(cfg, info, device) as trainer:  # the run's compiler settings too
                initial = initial_state(trainer.model)
                trainer.fit()
            if info.rank == 0:
                torch.save(initial, trainer.metrics.outdir / "initial.pt")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
