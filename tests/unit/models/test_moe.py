"""The MoE model against plain per-token references, and its pure helpers."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from loom.config import parse_args
from loom.models.moe.aux_loss import balance_loss_from_sums, sequence_balance_loss, sequence_sums
from loom.models.moe.balance import moe_metrics
from loom.models.moe.model import (
    GroupedExperts,
    MoE,
    MoEArgs,
    MoETransformer,
    active_param_count,
    expert_matmul,
    expert_param_count,
    weighted_combine,
)
from loom.models.resolve import model_args, plain_model
from loom.observability import flops
from loom.parallel.context import shard_sequence
from loom.parallel.expert import expert_order, window_counts
from loom.parallel.fsdp import expert_placement

ARGS = MoEArgs(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=61, multiple_of=32,
               max_seq_len=32, n_experts=6, top_k=2, n_shared_experts=1, moe_hidden_dim=16,
               n_dense_layers=1)


def build_moe(args: MoEArgs = ARGS, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(args)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    moe.reset_buffers()
    return moe


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the router's top-k experts, each a SwiGLU, weighted, plus shared."""
    flat = x.reshape(-1, x.shape[-1])
    top_scores, expert_idx, _ = moe.router(flat, moe.expert_bias)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    rows = []
    for t, token in enumerate(flat):
        out = moe.shared_experts(token)
        for weight, e in zip(top_scores[t], expert_idx[t], strict=True):
            out = out + weight * (w2[e] @ (F.silu(w1[e] @ token) * (w3[e] @ token)))
        rows.append(out)
    return torch.stack(rows).view_as(x)


def test_moe_matches_per_token_reference_and_counts_trained_picks():
    moe = build_moe()
    x = torch.randn(2, 5, ARGS.dim)
    out = moe(x)
    torch.testing.assert_close(out, reference_moe(moe, x), rtol=1e-5, atol=1e-5)
    assert moe.tokens_per_expert.sum() == 0, "counted before the backward"
    out.sum().backward()
    _, expert_idx, _ = moe.router(x.reshape(-1, ARGS.dim), moe.expert_bias)
    counts = torch.bincount(expert_idx.flatten(), minlength=ARGS.n_experts).float()
    torch.testing.assert_close(moe.tokens_per_expert, counts)
    with torch.no_grad():
        moe(x)  # evaluation trains nothing, so it must not move the expert bias
    torch.testing.assert_close(moe.tokens_per_expert, counts)


def test_moe_gradients_match_the_per_token_reference():
    moe = build_moe()
    x = torch.randn(2, 5, ARGS.dim, requires_grad=True)
    params = [x, moe.router.gate.weight, moe.experts.w1, moe.experts.w2, moe.experts.w3]
    grad_out = torch.randn_like(x)
    got = torch.autograd.grad(moe(x), params, grad_out)
    expected = torch.autograd.grad(reference_moe(moe, x), params, grad_out)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def written_out_combine(rows, weights, token_ids, like):
    """The combine as plain autograd ops: what `weighted_combine` must equal."""
    weighted = (rows.float() * weights[:, None]).to(like.dtype)
    return torch.zeros_like(like).index_add(0, token_ids, weighted)


def saved_storages(fn, *args) -> dict[int, tuple[int, torch.Size]]:
    """The distinct storages autograd keeps for backward while fn runs: bytes and shape."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return storages


def saved_bytes(fn, *args) -> int:
    return sum(nbytes for nbytes, _ in saved_storages(fn, *args).values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_combine_matches_the_written_out_sum_and_keeps_the_rows_once(dtype):
    torch.manual_seed(0)
    slots, tokens, dim = 24, 8, 16
    rows = torch.randn(slots, dim, dtype=dtype, requires_grad=True)
    weights = torch.rand(slots, requires_grad=True)
    token_ids = torch.randint(tokens, (slots,))
    like = torch.empty(tokens, dim, dtype=dtype)
    grad_out = torch.randn(tokens, dim, dtype=dtype)
    outs = [f(rows, weights, token_ids, like) for f in (weighted_combine, written_out_combine)]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    grads = [torch.autograd.grad(o, (rows, weights), grad_out) for o in outs]
    for got, expected in zip(*grads, strict=True):
        torch.testing.assert_close(got, expected)
    kept = saved_bytes(weighted_combine, rows, weights, token_ids, like)
    assert kept == rows.nbytes + weights.nbytes + token_ids.nbytes
    if dtype == torch.bfloat16:  # written out: fp32 rows for the weights' gradient, bf16 again
        assert saved_bytes(written_out_combine, rows, weights, token_ids, like) >= 3 * rows.nbytes


def test_a_bf16_moe_keeps_its_slot_rows_twice_for_backward():
    """The experts' input and output rows, (tokens * top_k, dim) each, in bf16; nothing
    else of that size (the combine used to keep the output again, and in fp32)."""
    moe = build_moe().to(torch.bfloat16)
    x = torch.randn(2, 5, ARGS.dim, dtype=torch.bfloat16, requires_grad=True)
    slots = (2 * 5 * ARGS.top_k, ARGS.dim)
    kept = [nbytes for nbytes, shape in saved_storages(moe, x).values() if shape == slots]
    assert kept == [slots[0] * slots[1] * 2] * 2


def test_activation_checkpoint_recompute_is_not_counted_twice():
    moe = build_moe()
    x = torch.randn(1, 8, ARGS.dim, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert moe.tokens_per_expert.sum() == 8 * ARGS.top_k


def test_expert_bias_changes_the_choice_but_not_the_weights():
    moe = build_moe()
    x = torch.randn(16, ARGS.dim)
    _, idx0, scores = moe.router(x, moe.expert_bias)
    bias = torch.zeros(ARGS.n_experts)
    bias[0] = 10.0  # expert 0 now always chosen
    top, idx, _ = moe.router(x, bias)
    assert (idx == 0).any(dim=1).all() and not (idx0 == 0).any(dim=1).all()
    chosen = scores.gather(1, idx)
    torch.testing.assert_close(top, chosen / chosen.sum(dim=1, keepdim=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_matmul_matches_a_loop_with_empty_groups(dtype):
    """bf16 takes torch._grouped_mm where torch has it; fp32 the loop. Both vs plain matmuls."""
    x = torch.randn(10, 16, dtype=dtype)
    w = torch.randn(3, 8, 16, dtype=dtype)
    counts = torch.tensor([4, 0, 6])
    expected = torch.cat([x[:4] @ w[0].T, x[4:] @ w[2].T])
    torch.testing.assert_close(expert_matmul(x, w, counts), expected)


def test_sequence_balance_loss_matches_its_definition():
    scores, idx = torch.rand(2 * 4, 6), torch.randint(6, (2 * 4, 2))
    probs = scores / scores.sum(-1, keepdim=True)
    expected = 0.0
    for b in range(2):
        rows = slice(4 * b, 4 * b + 4)
        picks = torch.bincount(idx[rows].flatten(), minlength=6).float()
        expected += (picks * 6 / (2 * 4) * probs[rows].mean(0)).sum() / 2
    torch.testing.assert_close(sequence_balance_loss(scores, idx, bsz=2), expected)


def test_balance_loss_of_summed_cp_shards_is_the_whole_sequences():
    """Context parallel: each cp rank's per-sequence sums over its chunks, added up, give the
    whole sequences' loss and its gradient (the sums are all that crosses ranks)."""
    scores = torch.rand(2 * 8, 6, requires_grad=True)
    idx = torch.randint(6, (2 * 8, 2))
    whole = sequence_balance_loss(scores, idx, bsz=2)
    expected, = torch.autograd.grad(whole, scores)

    def shard(t: torch.Tensor, rank: int) -> torch.Tensor:
        return shard_sequence(t.view(2, 8, -1), 2, rank).reshape(-1, t.shape[-1])

    sums = sum(sequence_sums(shard(scores, r), shard(idx, r), bsz=2) for r in range(2))
    summed = balance_loss_from_sums(sums, top_k=2)
    torch.testing.assert_close(summed, whole)
    torch.testing.assert_close(torch.autograd.grad(summed, scores)[0], expected)


def test_aux_loss_trains_the_router_without_changing_the_output():
    coeff = 0.5
    with_aux = build_moe(MoEArgs(**{**vars(ARGS), "aux_loss_coeff": coeff}))
    plain = build_moe()
    x = torch.randn(2, 4, ARGS.dim)
    out = with_aux(x)
    torch.testing.assert_close(out, plain(x))
    out.sum().backward()
    plain(x).sum().backward()
    flat = x.reshape(-1, ARGS.dim)
    _, idx, scores = plain.router(flat, plain.expert_bias)
    aux_grad, = torch.autograd.grad(coeff * sequence_balance_loss(scores, idx, 2),
                                    plain.router.gate.weight)
    torch.testing.assert_close(with_aux.router.gate.weight.grad,
                               plain.router.gate.weight.grad + aux_grad)
    torch.testing.assert_close(with_aux.aux_loss, coeff * sequence_balance_loss(scores, idx, 2))


def test_expert_order_regroups_rows_by_local_expert():
    per_rank = torch.tensor([[2, 0, 1], [1, 3, 0]])  # [source rank, local expert]
    labels = [(i, e) for i in range(2) for e in range(3) for _ in range(int(per_rank[i, e]))]
    order = expert_order(per_rank, len(labels))
    regrouped = [labels[j] for j in order.tolist()]
    assert regrouped == sorted(labels, key=lambda ie: (ie[1], ie[0]))


def test_window_counts_clip_groups_to_the_window():
    counts = torch.tensor([3, 0, 5, 2])
    rows = torch.repeat_interleave(torch.arange(4), counts)
    for lo, hi in [(0, 5), (5, 10), (2, 9)]:
        expected = torch.bincount(rows[lo:hi], minlength=4)
        assert window_counts(counts, lo, hi).tolist() == expected.tolist()


def test_moe_metrics_report_spread_and_imbalance():
    counts = torch.tensor([[4.0, 4.0, 4.0, 4.0], [8.0, 0.0, 4.0, 4.0]])
    row = moe_metrics(counts)
    assert row["moe/tokens_per_expert_min"] == 0 and row["moe/tokens_per_expert_max"] == 8
    assert row["moe/load_imbalance"] == 1.5 and row["moe/load_imbalance_max"] == 2.0
    assert "moe/aux_loss" not in row


def test_model_layout_and_active_parameters():
    with torch.device("meta"):
        model = MoETransformer(ARGS)
    names = {n for n, _ in model.named_parameters()}
    assert "layers.0.feed_forward.w1.weight" in names
    assert {"layers.1.moe.router.gate.weight", "layers.2.moe.experts.w2",
            "layers.2.moe.shared_experts.w3.weight"} <= names
    assert "layers.1.moe.expert_bias" in model.state_dict()
    total = sum(p.numel() for p in model.parameters())
    skipped = 2 * (ARGS.n_experts - ARGS.top_k) * expert_param_count(ARGS) // ARGS.n_experts
    unread = (ARGS.vocab_size - 1) * ARGS.dim  # the embedding rows a token does not look up
    assert model.active_param_count == active_param_count(ARGS) == total - skipped - unread


def test_expert_weights_are_sharded_off_dim_0_only_where_it_would_pad():
    experts = GroupedExperts(dim=40, hidden_dim=32, n_experts=4)  # w1 (4, 32, 40), w2 (4, 40, 32)
    other = torch.nn.Parameter(torch.empty(4, 32, 40))
    assert expert_placement([experts], 4)(experts.w1) is None, "4 experts split over 4 ranks"
    on_8 = expert_placement([experts], 8)
    assert on_8(experts.w1).dim == 1 and on_8(experts.w2).dim == 1
    on_16 = expert_placement([experts], 16)
    assert on_16(experts.w1).dim == 1 and on_16(experts.w2).dim == 2, "40 % 16, so dim 2"
    assert on_8(other) is None, "only the experts' weights"
    assert expert_placement([experts], 7)(experts.w1) is None, "no dim splits evenly: pad dim 0"


def test_six_times_the_active_count_is_the_steps_matmul_flops_per_token() -> None:
    """What `per_token_param_count` claims: 6 x it x tokens, plus attention's 12 x layers x
    dim x seq per token, is the traced count (the lookup counted as one row; the whole
    32,000-row table would make it 1.83x)."""
    cfg = parse_args(["--model", "moe-debug", "--seq-len", "64"])
    m = cfg.model
    traced = flops.count_step_flops(lambda: plain_model(cfg), 1, 64)
    active = active_param_count(model_args(cfg))
    assert 64 * (6 * active + 12 * m.n_layers * m.dim * 64) == pytest.approx(traced.flops,
                                                                              rel=1e-3)
