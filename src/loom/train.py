"""`loom train`: config -> runtime -> mesh -> data -> model -> parallelize -> optimizer -> loop."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loom.config import JobConfig, parse_args
from loom.data.loaders import RandomTokens, build_dataloader
from loom.losses import eager_cross_entropy
from loom.mesh import ParallelDims
from loom.metrics import RunWriter, environment_facts
from loom.models.llama import ModelArgs, Transformer
from loom.optim import build_optimizer, clip_grad_norm
from loom.parallel.init import init_weights
from loom.parallel.parallelize import parallelize_llama
from loom.runtime import (
    RankInfo,
    agree_on_seed,
    backend_for,
    init_distributed,
    rank_info,
    seed_everything,
    teardown,
)

logger = logging.getLogger("loom")


def model_args(cfg: JobConfig) -> ModelArgs:
    m = cfg.model
    return ModelArgs(dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
                     vocab_size=m.vocab_size, multiple_of=m.multiple_of,
                     ffn_dim_multiplier=m.ffn_dim_multiplier, hidden_dim=m.hidden_dim,
                     rope_theta=m.rope_theta, norm_eps=m.norm_eps, max_seq_len=m.max_seq_len)


def agree_on_outdir(outdir: str | None) -> Path:
    """The given folder, or a timestamped one chosen by rank 0 and shared with every rank."""
    if outdir is None:
        chosen = [f"outputs/{datetime.now():%Y-%m-%d-%H%M%S}"]
        dist.broadcast_object_list(chosen, src=0)
        outdir = chosen[0]
    return Path(outdir)


class Trainer:
    """Holds the built components; `fit()` runs the loop."""

    def __init__(self, cfg: JobConfig, info: RankInfo, dims: ParallelDims, device: torch.device):
        self.info, self.dims, self.device = info, dims, device
        dims.build_mesh(device.type)
        self.seed = agree_on_seed(cfg.train.seed, device)
        seed_everything(self.seed)
        self.cfg = cfg = replace(cfg, train=replace(cfg.train, seed=self.seed))
        self.loader = build_dataloader(
            RandomTokens(cfg.model.vocab_size, cfg.data.seq_len, self.seed),
            batch_size=cfg.train.batch_size, dp_rank=dims.dp_rank, dp_size=dims.dp_size,
            seed=self.seed, num_workers=cfg.data.num_workers)
        self.model = self.build_model()
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.writer = RunWriter(agree_on_outdir(cfg.output.outdir), info.rank)
        self.writer.write_config(self.effective_config())
        self.dp_group = dims.get_mesh("dp").get_group()

    def build_model(self) -> nn.Module:
        with torch.device("meta"):
            model = Transformer(model_args(self.cfg))
        parallelize_llama(model, self.dims, self.cfg.parallel, loss_parallel=False,
                          backend=backend_for(self.device))
        init_weights(model, self.seed, self.device)
        n_params = sum(p.numel() for p in model.parameters())
        logger.info("model: %s, %.2fM parameters", self.cfg.model.model or "custom",
                    n_params / 1e6)
        return model

    def effective_config(self) -> dict[str, Any]:
        return {**self.cfg.to_dict(), "world_size": self.info.world_size,
                "mesh": self.dims.degrees, "device": str(self.device),
                "global_batch_size": self.dims.global_batch_size(self.cfg.train.batch_size),
                "environment": environment_facts()}

    def train_step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, backward, clip, step; returns the (dp-averaged) loss and pre-clip norm."""
        inputs = batch["input"].to(self.device, non_blocking=True)
        labels = batch["labels"].to(self.device, non_blocking=True)
        loss = eager_cross_entropy(self.model(inputs), labels)
        loss.backward()
        grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.optim.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        reported = loss.detach().clone()
        dist.all_reduce(reported, group=self.dp_group)
        return reported / self.dims.dp_size, grad_norm

    def fit(self) -> None:
        cfg, dims = self.cfg, self.dims
        global_batch = dims.global_batch_size(cfg.train.batch_size)
        tokens_per_step = global_batch * cfg.data.seq_len
        steps_per_epoch = len(self.loader)
        total = steps_per_epoch * cfg.train.epochs
        if cfg.train.max_steps is not None:
            total = min(total, cfg.train.max_steps)
        logger.info("global batch %d (batch %d x dp %d), %d tokens/step, %d steps",
                    global_batch, cfg.train.batch_size, dims.dp_size, tokens_per_step, total)
        step, tokens_seen = 0, 0
        for epoch in range(cfg.train.epochs):
            self.loader.sampler.set_epoch(epoch)
            for bidx, batch in enumerate(self.loader):
                if step >= total:
                    return
                t0 = time.perf_counter()
                loss, grad_norm = self.train_step(batch)
                loss_value = loss.item()
                dt = time.perf_counter() - t0
                step += 1
                tokens_seen += tokens_per_step
                self.writer.log_step({
                    "train/iter": step, "train/epoch": epoch, "train/bidx": bidx,
                    "train/loss": loss_value, "train/dt": dt,
                    "train/tokens": tokens_per_step, "train/tokens_seen": tokens_seen,
                    "train/tps": tokens_per_step / dt,
                    "train/tps_per_gpu": tokens_per_step / dt / self.info.world_size,
                    "grad/norm_preclip": grad_norm.item()})

    def close(self) -> None:
        self.writer.close()


def parallel_dims(cfg: JobConfig, world_size: int) -> ParallelDims:
    p = cfg.parallel
    return ParallelDims(p.dp_replicate, p.dp_shard, p.tp, world_size)


def run(cfg: JobConfig, info: RankInfo, device: torch.device) -> Trainer:
    """Train one job in an initialised process group; returns the trainer for inspection."""
    trainer = Trainer(cfg, info, parallel_dims(cfg, info.world_size), device)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return trainer


def main(argv: Sequence[str]) -> None:
    """Validate everything that needs no process group first, so bad input fails on every
    rank at once, before any collective could hang."""
    cfg = parse_args(argv)
    info = rank_info()
    parallel_dims(cfg, info.world_size)
    for warning in cfg.warnings:
        logger.warning(warning)
    device = init_distributed(info)
    try:
        run(cfg, info, device)
    finally:
        teardown()
