"""A DeepSeek-V3-style mixture-of-experts Transformer built from the Llama blocks.

Pure PyTorch. Expert and tensor parallelism are applied from outside through two seams:
forward hooks around `MoE.router` and `MoE.experts` (token dispatch and combine), and the
experts' `weights` module (replaced by one that turns sharded weights into local tensors).
Context parallel sets `MoE.sequence_sum`, which completes the balance loss's per-sequence
sums over the ranks holding parts of each sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from loom.models.llama import model as llama
from loom.models.llama.model import FeedForward, ModelArgs, Transformer, TransformerBlock
from loom.models.moe.aux_loss import SequenceSum, add_loss, sequence_balance_loss
from loom.models.moe.counts import per_token_param_count

SCORE_FUNCS = ("sigmoid", "softmax")


@dataclass(frozen=True)
class MoEArgs(ModelArgs):
    n_experts: int = 8
    top_k: int = 2
    n_shared_experts: int = 1
    moe_hidden_dim: int | None = None
    n_dense_layers: int = 1
    score_func: str = "sigmoid"
    route_norm: bool = True
    route_scale: float = 1.0
    load_balance_coeff: float = 1e-3
    aux_loss_coeff: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func is {self.score_func!r}, not one of "
                             f"{', '.join(SCORE_FUNCS)}")
        if not 1 <= self.top_k <= max(1, self.n_experts):
            raise ValueError(f"top_k is {self.top_k}, not in [1, n_experts]")
        if self.moe_hidden_dim is not None and self.moe_hidden_dim < 1:
            raise ValueError(f"moe_hidden_dim is {self.moe_hidden_dim}, not at least 1")

    @property
    def expert_hidden_dim(self) -> int:
        return self.moe_hidden_dim or self.ffn_hidden_dim

    @property
    def n_moe_layers(self) -> int:
        return max(0, self.n_layers - self.n_dense_layers)


MOE_FIELDS = tuple(f.name for f in fields(MoEArgs) if f.name not in
                   {g.name for g in fields(ModelArgs)})
"""The settings a MoE model adds to the dense ones (named like the config fields)."""


class TokenChoiceRouter(nn.Module):
    """Each token picks its top-k experts. Scores are computed in fp32; the expert bias
    only changes which experts are picked, never the weights their outputs get."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)
        self.top_k, self.score_func = args.top_k, args.score_func
        self.route_norm, self.route_scale = args.route_norm, args.route_scale

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, dim) -> top-k weights (N, k) fp32, expert ids (N, k), all scores (N, E)."""
        logits = self.gate(x).float()
        scores = logits.sigmoid() if self.score_func == "sigmoid" else logits.softmax(dim=-1)
        _, expert_idx = (scores + expert_bias).topk(self.top_k, dim=-1)
        return self.weights_for(scores, expert_idx), expert_idx, scores

    def weights_for(self, scores: torch.Tensor, expert_idx: torch.Tensor) -> torch.Tensor:
        """The router weights (N, k) of the chosen experts, from all scores (N, E). Apart from
        the choice itself, so a caller that fixes the choice (a parity test replaying another
        run's routing) weights it exactly as the router would."""
        top_scores = scores.gather(-1, expert_idx)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        return top_scores * self.route_scale


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm needs 16-byte aligned rows and bf16: its CPU kernel takes fp32 too,
    but its meta kernel (fake tensors, torch.compile tracing) does not."""
    aligned = all(n * x.element_size() % 16 == 0 for n in w.shape[1:])
    return (hasattr(torch, "_grouped_mm") and aligned
            and x.dtype == w.dtype == torch.bfloat16)


@torch.library.custom_op("loom::looped_expert_mm", mutates_args=())
def looped_expert_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`expert_matmul` as a loop over the experts' row chunks. An operator of its own so that
    torch.compile sees one op with a static (M, out) result: traced, the host-side chunk
    sizes would be unbacked sizes that inductor's split/cat lowering cannot bound."""
    chunks = x.split(counts.tolist())
    return torch.cat([chunk @ w_e.T for chunk, w_e in zip(chunks, w, strict=True)])


@looped_expert_mm.register_fake
def _looped_expert_mm_shape(x: torch.Tensor, w: torch.Tensor,
                            counts: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("loom::looped_expert_mm_weight_grad", mutates_args=())
def looped_expert_mm_weight_grad(grad: torch.Tensor, x: torch.Tensor,
                                 counts: torch.Tensor) -> torch.Tensor:
    """The gradient of `looped_expert_mm`'s w: per expert, its rows' grad.T @ x (E, out, in)."""
    sizes = counts.tolist()
    return torch.stack([g.T @ rows for g, rows in zip(grad.split(sizes), x.split(sizes),
                                                       strict=True)])


@looped_expert_mm_weight_grad.register_fake
def _looped_expert_mm_weight_grad_shape(grad: torch.Tensor, x: torch.Tensor,
                                        counts: torch.Tensor) -> torch.Tensor:
    return grad.new_empty(counts.shape[0], grad.shape[1], x.shape[1])


def _looped_expert_mm_save(ctx: torch.autograd.function.FunctionCtx, inputs: tuple,
                           output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _looped_expert_mm_backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor,
                               ) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
    x, w, counts = ctx.saved_tensors
    grad_x = looped_expert_mm(grad, w.transpose(-2, -1), counts) \
        if ctx.needs_input_grad[0] else None
    grad_w = looped_expert_mm_weight_grad(grad, x, counts) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


looped_expert_mm.register_autograd(_looped_expert_mm_backward,
                                   setup_context=_looped_expert_mm_save)


def expert_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of x grouped by expert (counts[e] rows for expert e) times w[e].T: (M, in) ->
    (M, out) with w (E, out, in); a grouped matmul where torch has one, else a loop.
    In autocast's dtype, as neither is an autocast operator: over fp32 weights the grouped
    matmul's bf16 condition failed, and the loop reads `counts` to the host."""
    x, w = llama.in_compute_dtype(x), llama.in_compute_dtype(w)  # grads return in their dtype
    if _grouped_mm_ok(x, w):
        offsets = counts.cumsum(0, dtype=torch.int32)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    return looped_expert_mm(x, w, counts)


class ExpertWeights(nn.Module):
    """How the experts read their stacked weights: as stored. Expert parallelism registers
    a subclass that unwraps the sharded weights into this rank's local tensors."""

    def forward(self, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return weights


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked weights: w1, w3 (E, hidden, dim), w2 (E, dim, hidden)."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.weights = ExpertWeights()

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, dim), rows grouped by (local) expert; counts (E_local,) rows per expert."""
        w1, w2, w3 = self.weights(self.w1, self.w2, self.w3)
        h = F.silu(expert_matmul(x, w1, counts)) * expert_matmul(x, w3, counts)
        return expert_matmul(h, w2, counts)


class _CountInBackward(torch.autograd.Function):
    """Identity on x whose backward adds `counts` to `total`: picks are counted once per
    trained forward, also when activation checkpointing recomputes it (that recomputed
    forward's output is the one whose gradient is computed); forwards that train nothing
    (evaluation) are not counted, so they never move the expert bias."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        ctx.counts, ctx.total = counts, total
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.total.add_(ctx.counts)
        return grad, None, None


class _WeightedCombine(torch.autograd.Function):
    """Each token's sum of its slots' expert outputs times their router weights (in fp32).
    Written out, autograd would keep the slot rows three times until backward (in fp32 for
    the weights' gradient and again as the sum's input); this keeps them once, as they are."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weights: torch.Tensor, token_ids: torch.Tensor,
                like: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, weights, token_ids)
        weighted = (rows * weights[:, None]).to(like.dtype)
        return torch.zeros_like(like).index_add_(0, token_ids, weighted)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, weights, token_ids = ctx.saved_tensors
        slot_grad = grad.index_select(0, token_ids).float()
        grad_weights = (slot_grad * rows).sum(dim=-1) if ctx.needs_input_grad[1] else None
        grad_rows = slot_grad.mul_(weights[:, None]).to(rows.dtype)
        return grad_rows, grad_weights, None, None


def weighted_combine(rows: torch.Tensor, weights: torch.Tensor, token_ids: torch.Tensor,
                     like: torch.Tensor) -> torch.Tensor:
    """(N*k, dim) slot rows, (N*k,) fp32 weights, (N*k,) token of each slot -> (N, dim),
    shaped and typed like `like` (the tokens)."""
    return _WeightedCombine.apply(rows, weights, token_ids, like)


class MoE(nn.Module):
    """Routed experts (top-k of E, weighted by router scores) plus always-on shared experts.

    `tokens_per_expert` sums the picks since the last expert-bias update; the training loop
    all-reduces it and moves `expert_bias` towards balance (aux-loss-free balancing).
    `sequence_sum` completes the balance loss's per-sequence sums where this rank holds
    parts of the sequences: context parallel sets it to a sum over the cp ranks.
    """

    sequence_sum: SequenceSum | None = None
    forwards_per_step = 1
    """Forwards per optimizer step (accumulation steps times a pipeline's micro-batches;
    `weigh_balance_loss`, the family's `weigh_own_losses`). Each forward's balance loss
    weighs 1 / forwards_per_step, as the main loss's token mean weighs each micro-batch by
    its share of the step; `aux_loss` sums the shares (the step's balance loss), zeroed by
    the balance-loss metric hook."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.top_k, self.aux_loss_coeff = args.top_k, args.aux_loss_coeff
        self.load_balance_coeff = args.load_balance_coeff
        self.router = TokenChoiceRouter(args)
        self.experts = GroupedExperts(args.dim, args.expert_hidden_dim, args.n_experts)
        shared = args.n_shared_experts * args.expert_hidden_dim
        self.shared_experts = FeedForward(args.dim, shared) if shared else None
        self.register_buffer("expert_bias", torch.zeros(args.n_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_experts), persistent=False)
        self.register_buffer("aux_loss", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, dim = x.shape
        x = x.reshape(-1, dim)  # (N, dim)
        top_scores, expert_idx, scores = self.router(x, self.expert_bias)
        flat_idx = expert_idx.flatten()  # (N*k,) token-major
        counts = flat_idx.new_zeros(self.expert_bias.numel()).scatter_add_(
            0, flat_idx, torch.ones_like(flat_idx))  # (E,), a static shape for compile
        order = flat_idx.argsort(stable=True)  # slots grouped by expert
        token_ids = order // self.top_k
        routed = self.experts(x[token_ids], counts)  # (N*k, dim)
        out = weighted_combine(routed, top_scores.flatten()[order], token_ids, x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if out.requires_grad:
            out = _CountInBackward.apply(out, counts, self.tokens_per_expert)
        if self.aux_loss_coeff > 0 and self.training:
            aux = sequence_balance_loss(scores, expert_idx, bsz, self.sequence_sum)
            out = add_loss(out, aux * (self.aux_loss_coeff / self.forwards_per_step), self.aux_loss)
        return out.view(bsz, seqlen, dim)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Zero the bias and counters that `to_empty` left uninitialised."""
        for buf in (self.expert_bias, self.tokens_per_expert, self.aux_loss):
            buf.zero_()


class MoETransformerBlock(TransformerBlock):
    """A Llama block whose feed-forward is a mixture of experts (module name `moe`)."""

    ffn_name = "moe"

    def build_ffn(self, args: MoEArgs) -> nn.Module:  # type: ignore[override]
        return MoE(args)


def weigh_balance_loss(part: nn.Module, forwards: int) -> None:
    """The MoE families' `ModelSpec.weigh_own_losses`: every MoE layer of a built part weighs
    its balance loss 1 / forwards (the forwards of one optimizer step)."""
    for module in part.modules():
        if isinstance(module, MoE):
            module.forwards_per_step = forwards


class MoETransformer(Transformer):
    """The Llama Transformer with MoE blocks after the first `n_dense_layers` dense ones."""

    args: MoEArgs

    def build_block(self, layer_id: int) -> nn.Module:
        if layer_id < self.args.n_dense_layers:
            return super().build_block(layer_id)
        return MoETransformerBlock(self.args)

    def init_std(self, name: str) -> float | None:
        if name.endswith(("moe.experts.w2", "shared_experts.w2.weight")):
            return 0.02 / (2 * self.args.n_layers) ** 0.5
        return super().init_std(name)

    def init_buffers(self, device: torch.device) -> None:
        super().init_buffers(device)
        for module in self.modules():
            if isinstance(module, MoE):
                module.reset_buffers()

    @property
    def active_param_count(self) -> int:
        """Parameters one token multiplies through (the figure `loom plan`'s FLOPs count)."""
        return active_param_count(self.args)


def expert_param_count(args: MoEArgs) -> int:
    """Routed-expert parameters of one MoE layer."""
    return 3 * args.n_experts * args.dim * args.expert_hidden_dim


def active_param_count(args: MoEArgs) -> int:
    with torch.device("meta"):
        return per_token_param_count(MoETransformer(args), args.top_k, args.n_experts)
