"""Optional outputs beyond the run folder's basics: a Weights & Biases run (rank 0) and
debug histograms behind environment knobs ($LOOM_HIST_EVERY, $LOOM_HIST)."""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from loom.parallel.init import clean_name
from loom.safe_io import open_append

logger = logging.getLogger("loom")

HIST_KINDS = ("logits", "grads", "acts")
HIST_BINS = 64


class WandbRun:
    """A W&B run created before training starts, its files under the run folder.
    Project from $WANDB_PROJECT (default `loom`); WANDB_MODE=offline works without login."""

    def __init__(self, outdir: Path, config: dict[str, Any]):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "loom"), name=outdir.name,
                              dir=str(outdir), config=config)

    def log(self, row: dict[str, Any], step: int) -> None:
        self.run.log(row, step=step)

    def log_histograms(self, hists: dict[str, list[float]], norms: dict[str, float],
                       step: int) -> None:
        import numpy as np

        data: dict[str, Any] = {f"grad_norm/{k}": v for k, v in norms.items()}
        for name, (lo, hi, *counts) in hists.items():
            edges = np.linspace(lo, hi, len(counts) + 1)
            data[f"hist/{name}"] = self.wandb.Histogram(np_histogram=(counts, edges))
        self.run.log(data, step=step)

    def finish(self, summary: dict[str, Any] | None) -> None:
        if summary is not None:
            self.run.summary.update({k: v for k, v in summary.items() if k != "metrics"})
        self.run.finish()


def histogram(t: torch.Tensor) -> torch.Tensor:
    """[min, max, counts...] of this rank's local values, left on the device."""
    x = (t.to_local() if isinstance(t, DTensor) else t).detach().float()
    lo, hi = torch.aminmax(x)
    return torch.cat([lo.reshape(1), hi.reshape(1), torch.histc(x, bins=HIST_BINS)])


def layer_of(name: str) -> str:
    """'layers.3.attention.wq.weight' -> 'layer3'; 'tok_embeddings.weight' -> 'tok_embeddings'."""
    parts = clean_name(name).split(".")
    return f"layer{parts[1]}" if parts[0] == "layers" and len(parts) > 1 else parts[0]


class Histograms:
    """Every `every` steps (0 = off): histograms of logits and of each block's output
    (forward hooks), and per-layer gradient norms (local shards); written to
    `histograms-<rank>.jsonl` and W&B."""

    def __init__(self, outdir: Path, rank: int, every: int, kinds: str):
        self.every = every
        self.kinds = {k for k in kinds.split(",") if k} if every > 0 else set()
        self.path = outdir / f"histograms-{rank}.jsonl"
        self.model: nn.Module | None = None
        self.armed = False
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.hists: dict[str, torch.Tensor] = {}
        self.norms: dict[str, torch.Tensor] = {}

    def due(self, step: int) -> bool:
        return bool(self.kinds) and step % self.every == 0

    def attach(self, model: nn.Module) -> None:
        self.model, self.armed = model, self.due(1)
        modules = {}
        if "logits" in self.kinds and isinstance(getattr(model, "output", None), nn.Module):
            modules["logits"] = model.output
        if "acts" in self.kinds and isinstance(getattr(model, "layers", None), nn.ModuleDict):
            modules.update({f"acts/layer{name}": block for name, block in model.layers.items()})
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            if self.armed and isinstance(output, torch.Tensor):
                self.hists[name] = histogram(output)
        return record

    def gradients(self, step: int) -> None:
        """Per-layer gradient norms; called after clipping, before the optimizer update."""
        if "grads" not in self.kinds or not self.due(step) or self.model is None:
            return
        groups: dict[str, list[torch.Tensor]] = defaultdict(list)
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                groups[layer_of(name)].append(g.detach())
        for layer, grads in groups.items():
            norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
            self.norms[layer] = norms.norm()

    def flush(self, step: int, wandb: Any | None) -> None:
        """Write what this step recorded, then arm the hooks for the next step."""
        if self.hists or self.norms:
            hists = {k: v.tolist() for k, v in self.hists.items()}
            norms = {k: v.item() for k, v in self.norms.items()}
            self.hists, self.norms = {}, {}
            record = {"step": step, "grad_norms": norms,
                      "histograms": {k: {"min": v[0], "max": v[1], "counts": v[2:]}
                                     for k, v in hists.items()}}
            with open_append(self.path) as f:
                f.write(json.dumps(record) + "\n")
            if wandb is not None:
                wandb.log_histograms(hists, norms, step)
        self.armed = self.due(step + 1)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
