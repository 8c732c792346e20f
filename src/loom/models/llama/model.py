"""A Llama-style decoder: GQA attention with RoPE, SwiGLU feed-forward, RMSNorm.

Pure PyTorch. Tensor parallelism works from outside because attention infers its local
head count from the projected width (`view(..., -1, head_dim)`), never from ModelArgs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from loom.models.context import ForwardContext, context_of
from loom.models.documents import attention_mask, document_positions


@dataclass(frozen=True)
class ModelArgs:
    """A Llama-shaped model's arguments (a checkpoint records every field)."""

    dim: int = 256
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 4
    """Key/value heads (grouped-query attention: each serves n_heads / n_kv_heads)."""
    vocab_size: int = 32000
    multiple_of: int = 360
    """The feed-forward width is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    hidden_dim: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 32768
    head_dim: int = 0
    """Width of one attention head; 0: dim // n_heads (Qwen3 sets it apart from dim)."""
    qk_norm: bool = False
    """RMSNorm each head's queries and keys before RoPE (Qwen3)."""
    rope_factor: float = 1.0
    """Llama 3.1 RoPE scaling: long wavelengths divided by this (1: no scaling)."""
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    tie_embeddings: bool = False
    """The source ties the output projection to the embedding. loom trains them as two
    tensors that start equal, so tensor and pipeline parallel can place them apart; export
    writes them tied again while they are still equal."""

    def __post_init__(self) -> None:
        """Sizes a model cannot be built with are refused here, where every model's
        arguments pass (a checkpoint's `model_args` too: `loom.checkpoint.model_record`)."""
        for name in ("dim", "n_heads", "n_kv_heads", "vocab_size", "multiple_of",
                     "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} is {getattr(self, name)}, not at least 1")
        if not (self.rope_theta > 0 and self.norm_eps > 0):
            raise ValueError("rope_theta and norm_eps must be positive")
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)

    @property
    def ffn_hidden_dim(self) -> int:
        """4*dim, then 2/3 (SwiGLU has three matrices), then the multiplier, then rounded up."""
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """(head_dim // 2,) rotation frequencies; with Llama 3.1 scaling, wavelengths beyond
    original_max_seq_len / low_freq_factor slow down by `rope_factor`, those below
    original / high_freq_factor stay, and the band between blends the two linearly."""
    d = args.head_dim
    freqs = 1.0 / args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    if args.rope_factor == 1.0:
        return freqs
    wavelength = 2 * math.pi / freqs
    low, high = args.rope_low_freq_factor, args.rope_high_freq_factor
    blend = (args.rope_original_max_seq_len / wavelength - low) / (high - low)
    blended = (1 - blend) * freqs / args.rope_factor + blend * freqs
    long_wave = wavelength > args.rope_original_max_seq_len / low
    short_wave = wavelength < args.rope_original_max_seq_len / high
    return torch.where(long_wave, freqs / args.rope_factor,
                       torch.where(short_wave, freqs, blended))


def rope_table(args: ModelArgs) -> torch.Tensor:
    """(max_seq_len, head_dim // 2, 2) table of cos and sin, kept real so compile and
    DTensor never see complex numbers."""
    freqs = rope_frequencies(args)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (B, T, H, D) by the angles of the table's first T rows
    (positions 0 ... T-1, or the rows a caller picked for a sequence shard), or by a
    (B, T, D/2, 2) table of rows picked per sample."""
    seqlen = x.shape[1]
    if table.dim() == 4:  # (B, T, D/2, 2): positions of their own per sample (--doc-mask)
        cos, sin = table[:, :, None, :, 0], table[:, :, None, :, 1]  # (B, T, 1, D/2)
    else:
        cos, sin = table[:seqlen, None, :, 0], table[:seqlen, None, :, 1]  # (T, 1, D/2)
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The input's dtype out. In fp32 the plain expression; below it (bf16 under
        autocast or FSDP2's mixed precision) the statistic is still fp32, but no fp32 copy of
        `x` is made for backward: only `x`, the (.., 1) fp32 statistics and the normed
        output in x's dtype are saved, so the residual stream and its saved activations stay
        bf16 even where the weight is fp32 (autocast)."""
        if x.dtype == torch.float32:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        with torch.autocast(x.device.type, enabled=False):  # an fp32 policy would copy x
            rms = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        rstd = torch.rsqrt(rms.square() / x.shape[-1] + self.eps)
        return ((x * rstd).type_as(x) * self.weight).type_as(x)


def in_compute_dtype(h: torch.Tensor) -> torch.Tensor:
    """`h` in autocast's dtype where autocast is on (the embedding's output over fp32
    weights), so the residual stream is bf16 from its start; else `h` itself."""
    device = h.device.type
    if torch.is_autocast_enabled(device):
        return h.to(torch.get_autocast_dtype(device))
    return h


class CausalAttention(nn.Module):
    """softmax(q k^T / sqrt(D)) v over the local sequence, causal. K and V stay at GQA width
    (`enable_gqa`): no widened copies of them are made or saved for backward, and a
    replacement (context parallel) exchanges them small."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        """q (B, T, H, D), k and v (B, T, Hkv, D) -> (B, T, H, D). `mask` (B, 1, T, T) bool,
        True where a query may attend a key, or FlexAttention's block mask of the same,
        replaces the plain causal mask (--doc-mask)."""
        if isinstance(mask, BlockMask):
            out = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                 block_mask=mask, enable_gqa=q.shape[2] != k.shape[2])
            return out.transpose(1, 2)  # type: ignore[union-attr]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            is_causal=mask is None, enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.core = CausalAttention()

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        """`mask`: see CausalAttention; a keyword, so the tp plan's input layouts (x, rope)
        and a core without one (context parallel) stay as they are."""
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)  # (B, T, H, D)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)  # (B, T, Hkv, D)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = self.core(q, k, v) if mask is None else self.core(q, k, v, mask=mask)
        return self.wo(out.reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class OutputHead(nn.Linear):
    """The output projection. `head(h, apply=f)` returns `f(h, weight)` instead of logits:
    a fused loss reaches the weight inside the module's call, so every wrapper's hooks
    (FSDP's unshard, the tp plan's input layouts) apply to it as to a projection."""

    def forward(self, hidden: torch.Tensor,
                apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                ) -> torch.Tensor:
        return super().forward(hidden) if apply is None else apply(hidden, self.weight)


class TransformerBlock(nn.Module):
    """Pre-norm block: attention, then the feed-forward child named `ffn_name` (a dense
    FeedForward here; a variant builds another under its own checkpoint name)."""

    ffn_name = "feed_forward"

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.add_module(self.ffn_name, self.build_ffn(args))

    def build_ffn(self, args: ModelArgs) -> nn.Module:
        return FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, mask=mask)
        return h + getattr(self, self.ffn_name)(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token ids (B, T) -> logits (B, T, V), or final hidden states (B, T, dim).

    Build it on the meta device, parallelize it, then call `init_weights(seed)`. A pipeline
    stage is this model with the parts it does not hold set to None (the embedding; norm and
    head, which stay together) or deleted (blocks).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.build_block(i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = OutputHead(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope", rope_table(args), persistent=False)

    def build_block(self, layer_id: int) -> nn.Module:
        """Block `layer_id`; variants (the MoE model) override this."""
        return TransformerBlock(self.args)

    def forward(self, tokens: torch.Tensor, ctx: ForwardContext | None = None,
                ) -> torch.Tensor:
        """`tokens`: ids, or a previous pipeline stage's hidden states when this stage has no
        embedding. `ctx` (`loom.models.context`): what the layout hands this forward. Its
        `positions` index RoPE for a shard of longer sequences (context parallel); its
        `documents` (--doc-mask) restrict attention to each token's document and count
        positions from each document's start; or, for a shard, `positions` and `mask` as
        prepared from the whole sequences' documents. `hidden`: return the final hidden
        states; `head_apply(h, weight)`: a loss the head computes on its weight inside its
        call, returned instead of logits (called after this forward instead, the head would
        find its FSDP2 unit, with the final norm, already finished by the root's end of
        forward and gather it a second time)."""
        ctx = context_of(ctx)
        h = in_compute_dtype(self.tok_embeddings(tokens)) if self.tok_embeddings is not None \
            else tokens
        positions, mask = self.attention_inputs(ctx)
        rope = self.rope if positions is None else self.rope[positions]
        for layer in self.layers.values():
            h = layer(h, rope) if mask is None else layer(h, rope, mask=mask)
        if self.norm is None:
            return h
        return self.head(self.norm(h), ctx)

    def attention_inputs(self, ctx: ForwardContext
                         ) -> tuple[torch.Tensor | None, torch.Tensor | BlockMask | None]:
        """RoPE positions and attention mask of this forward: the document mask's where
        `documents` are given, else the context's own (a cp shard's, or none)."""
        if ctx.documents is not None:
            return (document_positions(ctx.documents),
                    attention_mask(ctx.documents, ctx.flex_mask))
        return ctx.positions, ctx.mask

    def head(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Normed hidden states -> what the context asks: a head-applied loss, the hidden
        states themselves, or logits."""
        if ctx.head_apply is not None:
            return self.output(h, apply=ctx.head_apply)
        return h if ctx.hidden else self.output(h)

    def init_std(self, name: str) -> float | None:
        """Initial std of a parameter; None for norm weights (ones). Residual-branch outputs
        are scaled down by depth so the residual stream's variance stays bounded."""
        if name.endswith("norm.weight"):
            return None
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            return 0.02 / math.sqrt(2 * self.args.n_layers)
        return 0.02

    def init_buffers(self, device: torch.device) -> None:
        """Recompute non-persistent buffers after `to_empty` left them uninitialised."""
        args = self.args
        self.rope = rope_table(args).to(device)

