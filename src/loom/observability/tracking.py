"""Optional outputs beyond the run folder's basics: trackers that receive every metrics row
where the row is written (a Weights & Biases run, TensorBoard event files; rank 0) and
debug histograms behind environment knobs ($LOOM_HIST_EVERY, $LOOM_HIST, $LOOM_HIST_BINS,
$LOOM_HIST_SAMPLES, $LOOM_HIST_LAYERS)."""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from loom.config import OutputConfig
from loom.models.registry import spec_of
from loom.parallel.init import clean_name
from loom.safe_io import open_append

logger = logging.getLogger("loom")

HIST_BINS = 64


TENSORBOARD_DIR = "tensorboard"
"""The run folder's subfolder of TensorBoard event files (`tensorboard --logdir <run>`)."""


class Tracker(Protocol):
    """An output fed each metrics row as it is written (at logging steps, never per step)."""

    def log(self, row: dict[str, Any], step: int) -> None: ...
    def finish(self, summary: dict[str, Any] | None) -> None: ...


class TensorBoardRun:
    """TensorBoard event files of every metrics row in `<run>/tensorboard/`: each numeric
    column a scalar at the row's step (a null column, such as an MFU above 100 %, is left
    out). A resumed run adds a new event file to the same folder; TensorBoard shows the
    later events of a repeated step."""

    def __init__(self, outdir: Path):
        from torch.utils.tensorboard import SummaryWriter  # optional: the config checked it

        self.writer = SummaryWriter(log_dir=str(outdir / TENSORBOARD_DIR))

    def log(self, row: dict[str, Any], step: int) -> None:
        for key, value in row.items():
            if type(value) in (int, float):
                self.writer.add_scalar(key, value, global_step=step)

    def finish(self, summary: dict[str, Any] | None) -> None:
        self.writer.close()


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


def histogram(t: torch.Tensor, bins: int = HIST_BINS, samples: int = 0) -> torch.Tensor:
    """[min, max, counts...] of this rank's local values (`samples` of them at an even
    stride when that is fewer: a bounded cost on large activations), left on the device."""
    x = (t.to_local() if isinstance(t, DTensor) else t).detach().float().flatten()
    if 0 < samples < x.numel():
        x = x[::x.numel() // samples][:samples]
    lo, hi = torch.aminmax(x)
    return torch.cat([lo.reshape(1), hi.reshape(1), torch.histc(x, bins=bins)])


def layer_of(name: str, blocks: str | None) -> str:
    """A parameter's group: 'layer3' for the fourth block's (`blocks`: the family's block
    container), else its top-level module ('tok_embeddings.weight' -> 'tok_embeddings')."""
    parts = clean_name(name).split(".")
    return f"layer{parts[1]}" if parts[0] == blocks and len(parts) > 1 else parts[0]


def block_child(block: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    """The block's attention or feed-forward module, under any wrapper (checkpointing)."""
    return next((m for n, m in block.named_modules() if clean_name(n) in names), None)


class Histograms:
    """Every `every` steps (0 = off): histograms of logits, of each selected block's output
    and of its attention and feed-forward outputs (forward hooks), and per-layer gradient
    norms (local shards); written to `histograms-<rank>.jsonl` and W&B."""

    def __init__(self, outdir: Path, rank: int, every: int, kinds: str, bins: int = HIST_BINS,
                 samples: int = 0, layers: str = "all"):
        self.every, self.bins, self.samples = every, bins, samples
        self.chosen = None if layers == "all" else {p.strip() for p in layers.split(",")}
        self.blocks_name: str | None = None
        self.kinds = {k for k in kinds.split(",") if k} if every > 0 else set()
        self.path = outdir / f"histograms-{rank}.jsonl"
        self.model: nn.Module | None = None
        self.armed = False
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.hists: dict[str, torch.Tensor] = {}
        self.norms: dict[str, torch.Tensor] = {}

    @classmethod
    def from_config(cls, outdir: Path, rank: int, o: OutputConfig) -> Histograms:
        return cls(outdir, rank, o.hist_every, o.hist, o.hist_bins, o.hist_samples,
                   o.hist_layers)

    def due(self, step: int) -> bool:
        return bool(self.kinds) and step % self.every == 0

    def layer_selected(self, index: str) -> bool:
        return self.chosen is None or index in self.chosen

    def attach(self, model: nn.Module) -> None:
        self.model, self.armed = model, self.due(1)
        modules = {}
        spec = spec_of(model)  # None: a container of pipeline stages (no histograms)
        parts = None if spec is None else spec.parts
        self.blocks_name = None if parts is None else parts.blocks
        head = None if spec is None else spec.output(model)
        if "logits" in self.kinds and head is not None:
            modules["logits"] = head
        blocks = None if spec is None else spec.blocks(model)
        blocks = {} if blocks is None else \
            {n: b for n, b in blocks.items() if self.layer_selected(n)}
        children = {"attn": () if parts is None or parts.attention is None
                    else (parts.attention,), "ffn": () if parts is None else parts.feed_forward}
        if "acts" in self.kinds:
            modules.update({f"acts/layer{name}": block for name, block in blocks.items()})
        for kind in ("attn", "ffn"):
            if kind in self.kinds:
                found = {f"{kind}/layer{n}": block_child(b, children[kind])
                         for n, b in blocks.items()}
                modules.update({k: m for k, m in found.items() if m is not None})
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            if self.armed and isinstance(output, torch.Tensor):
                self.hists[name] = histogram(output, self.bins, self.samples)
        return record

    def gradients(self, step: int) -> None:
        """Per-layer gradient norms; called after clipping, before the optimizer update."""
        if "grads" not in self.kinds or not self.due(step) or self.model is None:
            return
        groups: dict[str, list[torch.Tensor]] = defaultdict(list)
        for name, p in self.model.named_parameters():
            layer = layer_of(name, self.blocks_name)
            if layer.startswith("layer") and not self.layer_selected(layer[len("layer"):]):
                continue
            if p.grad is not None:
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                groups[layer].append(g.detach())
        for layer, grads in groups.items():
            norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
            self.norms[layer] = norms.norm()

    def recorded(self) -> bool:
        """Whether this step recorded something for `flush` to read and write."""
        return bool(self.hists or self.norms)

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
