"""MoE flags, presets, the ep/etp layout rules and the expert-bias update."""

import pytest
import torch
import torch.distributed as dist

from loom.config import ConfigError, parse_args
from loom.models.moe.balance import update_expert_bias
from loom.models.moe.flags import MoEFlags
from loom.models.moe.model import MoE, MoEArgs, MoETransformer, active_param_count
from loom.models.resolve import plain_model
from loom.parallel.mesh import ParallelDims
from tests.one_rank import one_rank_group


def test_moe_flags_select_the_moe_model():
    cfg = parse_args(["--model", "moe-debug", "--top-k", "3", "--score-func", "softmax",
                      "--no-route-norm", "--ep", "2"])
    m = cfg.model.flags_of(MoEFlags)
    assert (m.n_experts, m.top_k, m.score_func, m.route_norm) == (8, 3, "softmax", False)
    assert cfg.parallel.ep == 2
    with torch.device("meta"):
        assert isinstance(plain_model(cfg), MoETransformer)
        assert not isinstance(plain_model(parse_args(["--model", "debug"])), MoETransformer)


@pytest.mark.parametrize(("preset", "total_b", "active_b"), [
    ("moe-16b", 15.6, 2.36), ("moe-671b", 672.1, 37.75)])
def test_realistic_presets_total_and_active_parameters(preset, total_b, active_b):
    cfg = parse_args(["--model", preset])
    with torch.device("meta"):
        model = plain_model(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert abs(total / 1e9 - total_b) < 0.1
    assert abs(model.active_param_count / 1e9 - active_b) < 0.05


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "debug", "--ep", "2"], "need a mixture-of-experts model"),
    (["--model", "moe-debug", "--n-experts", "6", "--ep", "4"],
     "--n-experts 6 is not divisible by --ep 4"),
    (["--model", "moe-debug", "--ep", "4", "--dp-shard", "2"],
     "--ep 4 must divide --dp-shard x --cp x --tp = 2"),
    (["--model", "moe-debug", "--ep", "4", "--dp-shard", "2", "--tp", "2", "--etp", "2"],
     "--ep 4 must divide --dp-shard x --cp = 2"),
    (["--model", "moe-debug", "--ep", "8", "--dp-shard", "2", "--cp", "2", "--tp", "2",
      "--etp", "2"], "--ep 8 must divide --dp-shard x --cp = 4"),
    (["--model", "moe-debug", "--tp", "2", "--etp", "4"], "--etp 4 must be 1 or --tp 2"),
    (["--model", "moe-debug", "--top-k", "9"], "--top-k 9 must be in [1, --n-experts 8]"),
])
def test_bad_moe_settings_fail_with_one_line(argv, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_args(argv)


def test_ep_spans_dp_shard_cp_and_tp_at_etp_1_and_dp_shard_cp_at_etp_tp():
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=16, ep=2, etp=2)
    assert (dims.dp_shard, dims.expert_region, dims.efsdp, dims.dp_size) == (4, 4, 2, 8)
    assert dims.ep_enabled and dims.etp_enabled
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, tp=2, world_size=4, ep=4, etp=1)
    assert (dims.dp_shard, dims.expert_region, dims.efsdp) == (2, 4, 1)
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=2, cp=2, world_size=8, ep=4)
    assert (dims.expert_region, dims.efsdp) == (8, 2)
    with pytest.raises(ConfigError, match="--ep 8 must divide dp_shard x cp x --tp = 4"):
        ParallelDims(1, -1, 2, world_size=4, ep=8)
    with pytest.raises(ConfigError, match="--ep 4 must divide dp_shard x cp = 2"):
        ParallelDims(1, -1, 2, world_size=4, ep=4, etp=2)
    with pytest.raises(ConfigError, match="--etp 3 must be 1 or --tp 2"):
        ParallelDims(1, -1, 2, world_size=4, etp=3)


def test_expert_bias_moves_towards_balance():
    args = MoEArgs(dim=8, n_experts=4, top_k=1, load_balance_coeff=0.1)
    moe = MoE(args)
    moe.reset_buffers()
    moe.tokens_per_expert.copy_(torch.tensor([5.0, 1.0, 1.0, 1.0]))
    with one_rank_group():
        row = update_expert_bias(moe, lambda t: (dist.all_reduce(t), t)[1],
                                 dist.get_world_size())
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.1, 0.1, 0.1, 0.1]))
    assert moe.tokens_per_expert.sum() == 0
    assert row["moe/load_imbalance"] == 2.5


def test_a_skipped_update_leaves_the_expert_bias_and_keeps_the_counts():
    """`applied` 0.0 (a non-finite step the optimizer skipped on the device): the bias
    stays and the counts carry into the next step; 1.0 then moves it on both steps' counts."""
    args = MoEArgs(dim=8, n_experts=4, top_k=1, load_balance_coeff=0.1)
    moe = MoE(args)
    moe.reset_buffers()
    moe.tokens_per_expert.copy_(torch.tensor([1.0, 1.0, 1.0, 5.0]))
    with one_rank_group():
        update_expert_bias(moe, lambda t: t, 1, applied=torch.tensor(0.0))
        torch.testing.assert_close(moe.expert_bias, torch.zeros(4))
        torch.testing.assert_close(moe.tokens_per_expert, torch.tensor([1.0, 1.0, 1.0, 5.0]))
        moe.tokens_per_expert.add_(torch.tensor([5.0, 1.0, 1.0, 0.0]))  # the next step's
        update_expert_bias(moe, lambda t: t, 1, applied=torch.tensor(1.0))
    torch.testing.assert_close(moe.expert_bias, torch.tensor([-0.1, 0.1, 0.1, -0.1]))
    assert moe.tokens_per_expert.sum() == 0


def test_active_parameters_count_top_k_of_the_routed_experts():
    dense = MoEArgs(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=11, n_experts=4,
                    top_k=4, n_dense_layers=0)
    with torch.device("meta"):
        total = sum(p.numel() for p in MoETransformer(dense).parameters())
    assert active_param_count(dense) == total - (dense.vocab_size - 1) * dense.dim
