"""The memory check before allocation counts what a LoRA run holds: its adapters (weights,
gradients, AdamW states: 16 bytes each) and the frozen base (fp32 weights only: 4 bytes),
so a rank that would not fit is refused in one line before anything is built, and a LoRA
run of a base too large to fine-tune whole is not."""

from __future__ import annotations

import pytest
import torch

from loom.config import ConfigError, JobConfig, parse_args
from loom.config.resolved import settled
from loom.lora.converter import lora_targets_for
from loom.parallel.mesh import ParallelDims
from loom.trainer import resolve


def lora_resolved(cfg: JobConfig) -> JobConfig:
    """`cfg` with its LoRA targets settled as the resolver settles them."""
    return settled(cfg, lora_targets=lora_targets_for(cfg))


SHAPE = ["--model", "debug", "--dim", "256", "--n-layers", "2", "--n-heads", "4",
         "--n-kv-heads", "4", "--vocab-size", "1024", "--dataset", "random", "--seq-len", "32",
         "--max-seq-len", "32"]  # a small RoPE table: the parameters dominate


def fits(flags: list[str], free: int, monkeypatch) -> None:
    monkeypatch.setattr(resolve, "available_memory_bytes", lambda: free)
    cfg = lora_resolved(parse_args([*SHAPE, *flags]))
    resolve.check_fits(cfg, ParallelDims.from_config(cfg.parallel, 1), torch.device("cpu"))


def base_params() -> int:
    with torch.device("meta"):
        model = resolve.plain_model(parse_args(SHAPE))
    return sum(p.numel() for p in model.parameters())


def test_a_lora_run_is_sized_by_its_adapters_not_by_a_full_fine_tune(monkeypatch):
    n = base_params()
    free = 8 * n  # half of what a full fine-tune needs, twice the frozen base
    with pytest.raises(ConfigError, match="weights, gradients and AdamW states need"):
        fits([], free, monkeypatch)
    fits(["--lora-rank", "4"], free, monkeypatch)  # 4 n + 16 x (a few adapters)
    with pytest.raises(ConfigError, match="weights, gradients and AdamW states need"):
        fits(["--lora-rank", "256"], free, monkeypatch)  # adapters as large as their layers
