"""DeepSeek-V3: latent-attention blocks, the first `n_dense_layers` with a dense SwiGLU, the
rest loom's mixture of experts routed within the best expert groups, and optional
multi-token prediction (MTP) modules trained beside the main head.

Pure PyTorch, built from the Llama and MoE families' modules: the experts, their grouped
matmul, the expert bias and its aux-loss-free balancing hook are the MoE family's own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from loom.errors import ConfigError
from loom.models.context import ForwardContext, context_of
from loom.models.deepseek_v3.args import DeepseekV3Args
from loom.models.deepseek_v3.attention import LatentAttention, yarn_rope_table
from loom.models.llama.model import FeedForward, RMSNorm, in_compute_dtype
from loom.models.moe.model import MoE, MoETransformer, TokenChoiceRouter


class GroupLimitedRouter(TokenChoiceRouter):
    """Sigmoid scores; experts form `n_group` groups, each scored by its two best biased
    scores, and a token picks its top-k experts within its `topk_group` best groups."""

    def __init__(self, args: DeepseekV3Args):
        super().__init__(args)
        if args.score_func != "sigmoid":  # the flag is refused; a config built in Python too
            raise ConfigError(f"deepseek-v3's group-limited router scores by sigmoid, not "
                              f"{args.score_func}")
        self.n_group, self.topk_group = args.n_group, args.topk_group

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, dim) -> top-k weights (N, k) fp32, expert ids (N, k), all scores (N, E)."""
        scores = self.gate(x).float().sigmoid()
        biased = scores + expert_bias
        if self.n_group > 1:
            grouped = biased.unflatten(-1, (self.n_group, -1))  # (N, G, E/G)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (N, G)
            best = group_scores.topk(self.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            biased = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        expert_idx = biased.topk(self.top_k, dim=-1).indices
        return self.weights_for(scores, expert_idx), expert_idx, scores


class LatentBlock(nn.Module):
    """Pre-norm block: latent attention, then a dense feed-forward or routed experts."""

    def __init__(self, args: DeepseekV3Args, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = LatentAttention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if layer_id < args.n_dense_layers:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        else:
            self.moe = MoE(args)
            self.moe.router = GroupLimitedRouter(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, mask=mask)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class MTPModule(nn.Module):
    """One prediction depth: the previous depth's hidden state at i and the embedding of
    token i+k, each normed, projected together, through a block, then normed for the
    shared head (checkpoint names: enorm, hnorm, eh_proj, shared_head.norm)."""

    def __init__(self, args: DeepseekV3Args, layer_id: int):
        super().__init__()
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = LatentBlock(args, layer_id)
        self.norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, h: torch.Tensor, embedded: torch.Tensor, rope: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (this depth's hidden state, the same normed for the head): both inside this
        call, where a wrapper (an FSDP2 unit) holds the weights gathered. `mask`: the main
        blocks' (a depth attends within a document as they do)."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1))
        x = self.block(x, rope) if mask is None else self.block(x, rope, mask=mask)
        return x, self.norm(x)


class DeepseekV3(MoETransformer):
    """Token ids (B, T) -> logits (B, T, V). With `mtp_layers` > 0 and a context that asks
    for the extra depths (`ctx.depths`: the criterion does in training), it returns the
    main head's rows and, below them, each MTP depth's (logits, or the normed hidden
    states under `ctx.hidden`): ((1 + D) * B, T, ...). The model computes; the criterion
    scores depth d against the labels d ahead (`loom.losses.Criterion`)."""

    args: DeepseekV3Args

    def __init__(self, args: DeepseekV3Args):
        super().__init__(args)
        self.rope = yarn_rope_table(args)
        self.mtp = nn.ModuleDict({str(i): MTPModule(args, args.n_layers + i)
                                  for i in range(args.mtp_layers)}) if args.mtp_layers else None

    def build_block(self, layer_id: int) -> nn.Module:
        return LatentBlock(self.args, layer_id)

    def forward(self, tokens: torch.Tensor, ctx: ForwardContext | None = None,
                ) -> torch.Tensor:
        """As the Llama Transformer's. A whole model runs the MTP depths where `ctx.depths`
        asks; a pipeline stage of a model with MTP always packs the depths' rows (its
        neighbours' shapes are fixed), and its last stage returns them. The depths' ids
        come from `tokens`, or from `ctx.token_ids` (the whole sequences) where `tokens`
        are hidden states or a cp shard."""
        ctx = context_of(ctx)
        whole = self.tok_embeddings is not None and self.output is not None
        if not self.args.mtp_layers or (whole and not ctx.depths):
            return super().forward(tokens, ctx)
        return self.forward_with_mtp(tokens, ctx)

    def forward_with_mtp(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The tokens are shifted, not their embeddings: one embedding call for every
        depth, whose output tp may hold sequence-sharded (a shift would cross shards).
        Between pipeline stages the depths' embeddings travel below the hidden states, as
        rows (1 + depths) * B of one tensor, so their gradient flows back to the first
        stage's embedding like the hidden states'. Under cp `ctx.token_ids` are the whole
        sequences and `ctx.shard_index` this shard's positions: each depth's ids are
        picked from them."""
        depths = self.args.mtp_layers  # a stage without the MTP modules still packs
        positions, mask = self.attention_inputs(ctx)
        if self.tok_embeddings is not None:
            # at depth d position i sees token i+d; the last d see token 0, whose
            # targets the criterion ignores
            shifted = [F.pad(x[:, d:], (0, d)) if ctx.shard_index is None else
                       ahead(ctx.token_ids, ctx.shard_index + d) for d in range(1, depths + 1)]
            x = in_compute_dtype(self.tok_embeddings(torch.cat([x, *shifted])))
        h, embedded = x.tensor_split([x.shape[0] // (1 + depths)])
        rope = self.rope if positions is None else self.rope[positions]
        for layer in self.layers.values():
            h = layer(h, rope) if mask is None else layer(h, rope, mask=mask)
        if self.output is None:
            return torch.cat([h, embedded])
        hidden, prev = [self.norm(h)], h
        for module, shifted_embedded in zip(self.mtp.values(), embedded.chunk(depths),
                                            strict=True):
            prev, normed = module(prev, shifted_embedded, rope, mask)
            hidden.append(normed)
        return self.head(torch.cat(hidden, dim=0), ctx)  # one head call: (B * (1 + D), T, .)

    def init_buffers(self, device: torch.device) -> None:
        super().init_buffers(device)
        self.rope = yarn_rope_table(self.args).to(device)


def ahead(tokens: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The ids (B, len(index)) of `tokens` (B, T) at `index`; 0 past the end."""
    inside = index < tokens.shape[1]
    return tokens[:, index.clamp(max=tokens.shape[1] - 1)] * inside
