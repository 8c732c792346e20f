"""DeepSeek-V3: latent-attention blocks, the first `n_dense_layers` with a dense SwiGLU, the
rest loom's mixture of experts routed within the best expert groups, and optional
multi-token prediction (MTP) modules trained beside the main head.

Pure PyTorch, built from the Llama and MoE families' modules: the experts, their grouped
matmul, the expert bias and its aux-loss-free balancing hook are the MoE family's own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from loom.errors import ConfigError
from loom.models.deepseek_v3.args import DeepseekV3Args
from loom.models.deepseek_v3.attention import LatentAttention, yarn_rope_table
from loom.models.llama.model import FeedForward, RMSNorm
from loom.models.moe.aux_loss import add_loss
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
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (this depth's hidden state, the same normed for the head): both inside this
        call, where a wrapper (an FSDP2 unit) holds the weights gathered."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1))
        x = self.block(x, rope)
        return x, self.norm(x)


class DeepseekV3(MoETransformer):
    """Token ids (B, T) -> logits (B, T, V). Training with `mtp_layers` > 0 also runs the
    MTP modules and adds `mtp_loss_weight` times their mean loss in backward (the logits
    are the main head's alone); evaluation never runs them."""

    args: DeepseekV3Args

    def __init__(self, args: DeepseekV3Args):
        super().__init__(args)
        self.rope = yarn_rope_table(args)
        self.mtp = nn.ModuleDict({str(i): MTPModule(args, args.n_layers + i)
                                  for i in range(args.mtp_layers)}) if args.mtp_layers else None
        self.register_buffer("mtp_loss", torch.zeros(()), persistent=False)
        self.mtp_seen = 0  # forwards of this step recorded in mtp_loss

    def build_block(self, layer_id: int) -> nn.Module:
        return LatentBlock(self.args, layer_id)

    microbatches = 1
    """Forwards per optimizer step (the executor sets it: accumulation steps times a
    pipeline's micro-batches): each forward's MTP loss is weighted 1 / microbatches, so
    the step's batch weighs it once, as the main loss's token mean does."""

    @property
    def pipeline_rows(self) -> int:
        """Row blocks a pipeline stage hands the next per micro-batch row: the hidden
        states, then each MTP depth's embedded shifted tokens."""
        return 1 + self.args.mtp_layers

    @property
    def stage_token_ids(self) -> bool:
        """Whether every pipeline stage is handed the micro-batch's ids (`token_ids`): the
        last one scores the MTP depths against them."""
        return self.args.mtp_layers > 0

    def forward(self, tokens: torch.Tensor, return_hidden: bool = False,
                positions: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                mask: torch.Tensor | None = None,
                head_apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """As the Llama Transformer's; MTP runs only training, with plain logits out, where
        this is one whole model given token ids or a pipeline stage (`token_ids`: the
        micro-batch's ids, which every stage is handed), or this cp rank's shard given
        its `positions` and `token_ids`, the whole sequences (the plan's cp hook)."""
        whole = self.tok_embeddings is not None and self.output is not None
        training = self.training and torch.is_grad_enabled()
        if not self.args.mtp_layers or (whole and not training):
            return super().forward(tokens, return_hidden, positions, documents, mask,
                                   head_apply)
        # refused before a model is built (DeepseekV3Flags.check, the parallel plan); a
        # caller that skips those checks gets the one line, not a silently dropped mask
        if not (documents is None and head_apply is None and (positions is None or (
                token_ids is not None and positions.dim() == 1))
                and not (return_hidden or self.hidden_output)):
            raise ConfigError("deepseek-v3 multi-token prediction needs whole sequences and "
                              "plain logits (no --doc-mask, fused-linear or loss-parallel "
                              "loss); set --mtp-layers 0")
        return self.forward_with_mtp(tokens, tokens if token_ids is None else token_ids,
                                     positions)

    def forward_with_mtp(self, x: torch.Tensor, tokens: torch.Tensor | None,
                         positions: torch.Tensor | None = None) -> torch.Tensor:
        """The tokens are shifted, not their embeddings: one embedding call for every
        depth, whose output tp may hold sequence-sharded (a shift would cross shards).
        Between pipeline stages the depths' embeddings travel below the hidden states, as
        rows (1 + depths) * B of one tensor, so their gradient flows back to the first
        stage's embedding like the hidden states'. Under cp `tokens` are the whole
        sequences, `positions` this shard's: each depth's ids are picked from them."""
        depths = self.args.mtp_layers  # a stage without the MTP modules still packs
        if self.tok_embeddings is not None:
            # at depth d position i sees token i+d; the last d see token 0, which only
            # later positions attend to and no loss reads
            shifted = [F.pad(x[:, d:], (0, d)) if positions is None else
                       ahead(tokens, positions + d) for d in range(1, depths + 1)]
            x = self.tok_embeddings(torch.cat([x, *shifted]))
        h, embedded = x.tensor_split([x.shape[0] // (1 + depths)])
        rope = self.rope if positions is None else self.rope[positions]
        for layer in self.layers.values():
            h = layer(h, rope)
        if self.output is None:
            return torch.cat([h, embedded])
        if not (self.training and torch.is_grad_enabled()):  # a last stage evaluating
            return self.output(self.norm(h))
        assert tokens is not None, "a pipeline's last stage needs the micro-batch's ids"
        hidden, prev = [self.norm(h)], h
        for module, shifted_embedded in zip(self.mtp.values(), embedded.chunk(depths),
                                            strict=True):
            prev, normed = module(prev, shifted_embedded, rope)
            hidden.append(normed)
        logits = self.output(torch.cat(hidden, dim=0))  # one head call: (B * (1 + D), T, V)
        main, *extra = logits.chunk(len(hidden), dim=0)
        loss = mtp_loss(extra, tokens, positions) * (self.args.mtp_loss_weight
                                                     / self.microbatches)
        with torch.no_grad():
            self.record_mtp_loss(loss.detach() / max(self.args.mtp_loss_weight, 1e-30))
        return add_loss(main, loss)

    def record_mtp_loss(self, share: torch.Tensor) -> None:
        """The metric: the step's MTP loss, summed over its forwards' shares."""
        if self.mtp_seen == 0:
            self.mtp_loss.copy_(share)
        else:
            self.mtp_loss.add_(share)
        self.mtp_seen = (self.mtp_seen + 1) % self.microbatches

    def init_buffers(self, device: torch.device) -> None:
        super().init_buffers(device)
        self.rope = yarn_rope_table(self.args).to(device)
        self.mtp_loss.zero_()
        self.mtp_seen = 0


def ahead(tokens: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The ids (B, len(index)) of `tokens` (B, T) at `index`; 0 past the end."""
    inside = index < tokens.shape[1]
    return tokens[:, index.clamp(max=tokens.shape[1] - 1)] * inside


def mtp_loss(logits: list[torch.Tensor], tokens: torch.Tensor,
             positions: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over depths of each depth's cross-entropy: at depth d, position i predicts token
    i + d + 1 (positions whose target lies past the sequence are left out). Under cp the
    logits are a shard's (at `positions` of the whole `tokens`): its sum over the whole
    sequences' count, times the cp ranks, whose gradient average then counts it once."""
    length, losses = tokens.shape[1], []
    for depth, depth_logits in enumerate(logits, start=1):
        if positions is None:  # static shapes: a whole-model compile traces it whole
            valid = length - depth - 1
            losses.append(F.cross_entropy(depth_logits[:, :valid].flatten(0, 1).float(),
                                          tokens[:, depth + 1:].flatten()))
            continue
        index = positions + depth + 1
        inside = index < length
        total = F.cross_entropy(depth_logits[:, inside].flatten(0, 1).float(),
                                tokens[:, index[inside]].flatten(), reduction="sum")
        count = tokens.shape[0] * (length - depth - 1)
        losses.append(total * (length / positions.numel()) / count)
    return torch.stack(losses).mean()
