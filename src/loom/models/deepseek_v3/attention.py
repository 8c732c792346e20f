"""Multi-head latent attention (DeepSeek-V2/V3), in the plain form: the key/value latent is
expanded to per-head keys and values before attention, as transformers computes it, so the
same weights give the same logits. YaRN's RoPE table and softmax temperature live here too.

Tensor parallel splits the heads (`wq`/`wq_b`, `wkv_b` column-wise, `wo` row-wise) and keeps
the low-rank down-projections whole; the one RoPE key every head shares passes
`shared_key`, where the plan sums its gradient over the heads' ranks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from loom.models.deepseek_v3.args import DeepseekV3Args, yarn_mscale
from loom.models.llama.model import CausalAttention, RMSNorm, apply_rope

LATENT_EPS = 1e-6
"""The latents' RMSNorm epsilon: DeepSeek-V3 fixes it (rms_norm_eps is the blocks')."""


def yarn_frequencies(args: DeepseekV3Args) -> torch.Tensor:
    """(qk_rope_head_dim // 2,) frequencies: YaRN blends the interpolated (slowed by
    `yarn_factor`) and original ones by a ramp over the rotations a channel makes within
    the original context (beta_fast .. beta_slow of them)."""
    d, base = args.qk_rope_head_dim, args.rope_theta
    freqs = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    if args.yarn_factor == 1.0:
        return freqs

    def channel(rotations: float) -> float:  # the channel making `rotations` turns
        turns = args.yarn_original_max_seq_len / (rotations * 2 * math.pi)
        return d * math.log(turns) / (2 * math.log(base))

    low = max(math.floor(channel(args.yarn_beta_fast)), 0)
    high = min(math.ceil(channel(args.yarn_beta_slow)), d - 1)
    span = high - low if high != low else 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / span).clamp(0, 1)
    return freqs / args.yarn_factor * ramp + freqs * (1 - ramp)


def yarn_rope_table(args: DeepseekV3Args) -> torch.Tensor:
    """(max_seq_len, qk_rope_head_dim // 2, 2) cos and sin, times YaRN's attention factor
    (mscale / mscale_all_dim where both are set, else the factor's own temperature)."""
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32),
                         yarn_frequencies(args))
    gain = 1.0
    if args.yarn_factor != 1.0:
        gain = (yarn_mscale(args.yarn_factor, args.yarn_mscale)
                / yarn_mscale(args.yarn_factor, args.yarn_mscale_all_dim)
                if args.yarn_mscale and args.yarn_mscale_all_dim
                else yarn_mscale(args.yarn_factor))
    return torch.stack((angles.cos() * gain, angles.sin() * gain), dim=-1)


class LatentAttention(nn.Module):
    """Queries through an optional low-rank bottleneck; keys and values from one shared
    latent (kv_lora_rank wide) plus a RoPE key every head shares."""

    def __init__(self, args: DeepseekV3Args):
        super().__init__()
        self.nope, self.rope_dim, self.v_dim = (args.qk_nope_head_dim, args.qk_rope_head_dim,
                                                args.v_head_dim)
        self.kv_rank = args.kv_lora_rank
        q_width = args.n_heads * args.qk_head_dim
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, LATENT_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, q_width, bias=False)
        else:
            self.wq = nn.Linear(args.dim, q_width, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, LATENT_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (self.nope + self.v_dim),
                               bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_dim, args.dim, bias=False)
        self.shared_key = nn.Identity()
        self.core = CausalAttention()
        # SDPA scales by 1/sqrt(qk width); YaRN's extra temperature is folded into q
        self.q_gain = args.softmax_scale * math.sqrt(args.qk_head_dim) \
            if args.yarn_mscale_all_dim and args.yarn_factor != 1.0 else None

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "wq"):
            return self.wq(x)
        return self.wq_b(self.q_norm(self.wq_a(x)))

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.queries(x).view(bsz, seqlen, -1, self.nope + self.rope_dim)  # (B, T, H, Dqk)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        k_rope = self.shared_key(apply_rope(k_rope.unsqueeze(2), rope))  # (B, T, 1, R)
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seqlen, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # (B, T, H, Dn), (B, T, H, Dv)
        q = torch.cat([q_nope, apply_rope(q_rope, rope)], dim=-1)
        if self.q_gain is not None:
            q = q * self.q_gain
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        width = q.shape[-1]
        if self.v_dim < width:  # flash kernels (context parallel's) want one head width
            v = F.pad(v, (0, width - self.v_dim))
        out = self.core(q, k, v) if mask is None else self.core(q, k, v, mask=mask)
        return self.wo(out[..., :self.v_dim].reshape(bsz, seqlen, -1))
