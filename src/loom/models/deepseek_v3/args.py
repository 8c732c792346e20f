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

from loom.models.moe.model import MoEArgs

MAX_SIZE = 1 << 20
"""Bound on every MLA width (the largest released model's are ~1000x below it)."""


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
        for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group"):
            if not 1 <= getattr(self, name) <= MAX_SIZE:
                raise ValueError(f"{name} is {getattr(self, name)}, not in [1, {MAX_SIZE}]")
        for name in ("q_lora_rank", "qk_nope_head_dim", "mtp_layers"):
            if not 0 <= getattr(self, name) <= MAX_SIZE:
                raise ValueError(f"{name} is {getattr(self, name)}, not in [0, {MAX_SIZE}]")
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
        if not (self.yarn_factor >= 1 and math.isfinite(self.yarn_factor)):
            raise ValueError(f"yarn_factor is {self.yarn_factor}, not at least 1")
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
