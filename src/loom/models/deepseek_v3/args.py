"""DeepSeek-V3's arguments: loom's MoE settings plus multi-head latent attention, grouped
routing, YaRN and multi-token prediction.

The settings only this family has are its flags (`flags.DeepseekV3Flags`): a preset's row
sets them, a Hugging Face folder's config.json fills them when the run is resolved
(`hf.mla_fields`), a user may set them; a width still unset takes DeepSeek-V3's proportions
of --dim and --n-heads (`derived`). So the arguments are a function of the config alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from loom.config.declare import COUNT_MAX, SIZE_MAX, bounds
from loom.config.numbers import check_number
from loom.models.moe.model import MoEArgs

YARN_RANGES: dict[str, dict[str, float]] = {
    "rope_theta": dict(gt=1, le=1e12), "factor": dict(ge=1, le=2**10),
    "beta_fast": dict(gt=0, le=2**10), "beta_slow": dict(gt=0, le=2**10),
    "mscale": dict(le=10), "mscale_all_dim": dict(le=10)}
"""The RoPE numbers' ranges, declared once: the `--yarn-*` flags (`flags.py`) and a
config.json's fields (`YARN_BOUNDS`) are held to them."""

YARN_BOUNDS = {name: bounds(**limits) for name, limits in YARN_RANGES.items()}
"""Bounds of the RoPE numbers (config.json's names; the fields are `yarn_<name>`): the
rotary channel a YaRN beta names divides by the logs of theta and of the context over
beta, and the mscales multiply the attention's softmax scale (squared). Released models
use theta ~1e4-1e7, factor <= 64, betas 1-32, mscales <= 1."""


@dataclass(frozen=True)
class DeepseekV3Args(MoEArgs):
    q_lora_rank: int = 0
    """Width of the query's low-rank down-projection (0: one full-rank query projection)."""
    kv_lora_rank: int = 64
    """Width of the compressed key/value latent (what an inference cache would hold)."""
    qk_nope_head_dim: int = 32
    """Per-head query/key channels without position (expanded from the latent)."""
    qk_rope_head_dim: int = 16
    """Per-head query channels with RoPE; keys share one such part across heads."""
    v_head_dim: int = 32
    n_group: int = 1
    """Expert groups; a token routes within its `topk_group` best groups only."""
    topk_group: int = 1
    yarn_factor: float = 1.0
    """YaRN context extension factor (1: plain RoPE)."""
    yarn_original_max_seq_len: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    mtp_layers: int = 0
    """Multi-token prediction modules (DeepSeek-V3: 1); trained only, never exported."""
    mtp_loss_weight: float = 0.3
    """Weight of the mean MTP loss added to the main loss."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, low, high in (("kv_lora_rank", 1, SIZE_MAX), ("qk_rope_head_dim", 1, SIZE_MAX),
                                ("v_head_dim", 1, SIZE_MAX), ("n_group", 1, COUNT_MAX),
                                ("topk_group", 1, COUNT_MAX), ("q_lora_rank", 0, SIZE_MAX),
                                ("qk_nope_head_dim", 0, SIZE_MAX), ("mtp_layers", 0, COUNT_MAX)):
            check_number(name, getattr(self, name), bounds(ge=low, le=high), integer=True)
        for name, limits in YARN_BOUNDS.items():
            field = "rope_theta" if name == "rope_theta" else f"yarn_{name}"
            if name != "rope_theta" or self.yarn_factor != 1.0:  # plain RoPE takes any theta
                check_number(field, getattr(self, field), limits)
        if self.n_experts < 2 and self.n_layers > self.n_dense_layers:
            raise ValueError(f"n_experts is {self.n_experts}: blocks after the first "
                             f"{self.n_dense_layers} route among at least 2 experts")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim is {self.qk_rope_head_dim}, not even")
        if self.n_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(f"n_group {self.n_group} must divide n_experts {self.n_experts} "
                             f"and topk_group {self.topk_group} must not exceed it")
        if self.n_group > 1 and self.n_experts // self.n_group < 2:
            raise ValueError("each expert group needs at least 2 experts (groups are scored "
                             "by their two best)")
        if self.topk_group * (self.n_experts // self.n_group) < self.top_k:
            raise ValueError(f"topk_group {self.topk_group} groups hold fewer than top_k "
                             f"{self.top_k} experts")
        if not self.mtp_loss_weight >= 0:
            raise ValueError(f"mtp_loss_weight is {self.mtp_loss_weight}, not at least 0")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk width), times YaRN's mscale(factor, mscale_all_dim) squared."""
        mscale = yarn_mscale(self.yarn_factor, self.yarn_mscale_all_dim) \
            if self.yarn_mscale_all_dim else 1.0
        return self.qk_head_dim ** -0.5 * mscale * mscale


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(factor) + 1 (1 without scaling)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


MLA_FIELDS = tuple(f.name for f in fields(DeepseekV3Args)
                   if f.name not in {g.name for g in fields(MoEArgs)})
"""The family's own fields, each a flag of `DeepseekV3Flags` (unset widths: `derived`)."""

def derived(dim: int, n_heads: int) -> dict[str, Any]:
    """MLA widths for a model given only its width and heads (a --family deepseek-v3 run
    without a preset): DeepSeek-V3's proportions (latent dim / 14, rope = nope / 2)."""
    head = max(2, dim // n_heads)
    return dict(q_lora_rank=0, kv_lora_rank=max(1, dim // 14),
                qk_nope_head_dim=head, qk_rope_head_dim=max(2, head // 2 // 2 * 2),
                v_head_dim=head)
