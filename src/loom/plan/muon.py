"""The Newton-Schulz work `--optimizer muon` adds to a step, for `loom plan`'s step time.

Each Muon matrix (a block's 2-D weight, or each expert's slice of a 3-D one: the rule the
optimizer itself applies, `loom.trainer.optim.takes_muon`) is orthogonalized whole by one
rank once per step; the matrices are spread over the ranks (`loom.parallel.orthogonalize`),
so a rank does about 1/world of the work. One quintic iteration on an m x n matrix (m <= n)
is X Xᵀ (2 m² n), the polynomial in it (2 m³) and its product with X (2 m² n). The gathers
and scatters that move the matrices are not counted (they overlap nothing and are small
beside FSDP's traffic at the presets' shapes: an assumption, stated in docs/planning.md).
"""

from __future__ import annotations

from functools import cache

import torch

from loom.config import JobConfig, ModelConfig
from loom.models.resolve import plain_model
from loom.trainer.optim import takes_muon


def iteration_flops(rows: int, cols: int) -> float:
    """FLOPs of one Newton-Schulz quintic step on a rows x cols matrix."""
    m, n = min(rows, cols), max(rows, cols)
    return 4.0 * m * m * n + 2.0 * m ** 3


@cache
def newton_schulz_flops(model: ModelConfig, ns_steps: int) -> float:
    """FLOPs of one optimizer step's orthogonalizations over the whole model (built on
    the meta device: shapes only)."""
    with torch.device("meta"):
        built = plain_model(JobConfig(model=model))
    total = 0.0
    for name, param in built.named_parameters():
        if takes_muon(name, param):
            copies = param.shape[0] if param.ndim == 3 else 1  # experts' matrices apiece
            total += copies * ns_steps * iteration_flops(*param.shape[-2:])
    return total


def muon_flops_per_rank(cfg: JobConfig, world_size: int) -> float:
    """A rank's share of the step's Newton-Schulz FLOPs (0 under AdamW)."""
    if cfg.optim.optimizer != "muon":
        return 0.0
    return newton_schulz_flops(cfg.model, cfg.optim.muon_ns_steps) / world_size
