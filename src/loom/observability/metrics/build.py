"""Building the rank's metrics from the job's config: the no-op when metrics are off,
otherwise the run's facts (FLOPs counted on the unparallelized model), the trackers and the
recorder, watching model and optimizer. Apart from the recorder (`recorder`) because it
runs once, before training, and is what pulls in the config and the trackers' writers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

import torch
from torch import nn

from loom.config import JobConfig
from loom.observability import flops
from loom.observability.metrics.facts import peak_cache, run_dtype, run_facts, step_flops
from loom.observability.metrics.health import LogitsTracker
from loom.observability.metrics.recorder import Metrics
from loom.observability.metrics.sink import NullMetrics, RunMetrics, RunPlace
from loom.observability.progress import Progress
from loom.observability.tracking import Histograms, TensorBoardRun, WandbRun


def build_metrics(cfg: JobConfig, place: RunPlace, model: nn.Module,
                  optimizer: torch.optim.Optimizer,
                  build_model: Callable[[JobConfig], nn.Module]) -> RunMetrics:
    """The rank's metrics (or the no-op when metrics are off), watching model and optimizer.
    FLOPs are counted on `build_model(cfg)`, the unparallelized model, only when metrics
    are on. W&B's run and TensorBoard's writer are created here, before training starts."""
    out, main, device = cfg.output, place.rank == 0, place.device
    if not out.metrics:
        return NullMetrics(place.outdir, place.rank)
    facts = run_facts(cfg, place.dims, device, sum(p.numel() for p in model.parameters()),
                      step_flops(cfg, build_model))
    wandb = WandbRun(place.outdir, cfg.to_dict() | {"derived": asdict(facts)}) \
        if out.wandb and main else None
    metrics = Metrics(place, facts, health_every=out.health_every,
                      progress=Progress(out.log_every, enabled=main), wandb=wandb,
                      histograms=Histograms.from_config(place.outdir, place.rank, out),
                      remeasure=lambda: flops.peak_flops(device, run_dtype(cfg, device),
                                                         peak_cache(cfg), remeasure=True),
                      logits=LogitsTracker() if out.track_logits else None,
                      trackers=(TensorBoardRun(place.outdir),) if out.tensorboard and main
                      else ())
    metrics.watch(model, optimizer)
    return metrics
