"""Context parallel on one process: load-balanced sharding round trip, RoPE positions, the
global mask offsets of each rank's attention, and the one-line errors of --cp."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom.cli import run_train
from loom.models.llama.model import CausalAttention
from loom.parallel.context import (
    causal_offset_mask,
    prefix_causal_attention,
    shard_positions,
    shard_sequence,
    sharded_causal_attention,
    unshard_sequence,
)
from loom.parallel.mesh import MESH_DIMS, ParallelDims
from tests.compare import worst


def test_cp_ranks_share_samples_but_not_tokens():
    dims = ParallelDims(1, -1, 2, world_size=8, cp=2)
    assert MESH_DIMS.index("dp_shard") < MESH_DIMS.index("cp") < MESH_DIMS.index("tp")
    assert dims.degrees == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2}
    assert dims.dp_size == 2 and dims.global_batch_size(3) == 6  # cp ranks share samples
    assert dims.loss_size == 4  # ... and split their tokens: losses and gradients over dp x cp


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shards_round_trip_and_balance_causal_work(cp):
    seq = 8 * cp
    x = torch.arange(2 * seq).reshape(2, seq) * 10
    shards = [shard_sequence(x, cp, r) for r in range(cp)]
    assert all(s.shape == (2, seq // cp) for s in shards)
    assert torch.equal(unshard_sequence(torch.cat(shards, dim=1), cp), x)
    positions = [shard_positions(seq, cp, r) for r in range(cp)]
    assert all(torch.equal(s[0], p * 10) for s, p in zip(shards, positions, strict=True))
    assert sorted(torch.cat(positions).tolist()) == list(range(seq))
    causal_keys = {int((p + 1).sum()) for p in positions}  # keys each rank's queries see
    assert len(causal_keys) == 1, f"unbalanced causal work across cp ranks: {causal_keys}"


def test_unshard_other_dim():
    x = torch.randn(12, 3, 5)
    shards = torch.cat([shard_sequence(x, 3, r, dim=0) for r in range(3)], dim=0)
    assert torch.equal(unshard_sequence(shards, 3, dim=0), x)


def test_causal_offset_mask():
    mask = causal_offset_mask(2, 6, offset=3)
    expected = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    assert torch.equal(mask, expected), mask
    assert torch.equal(causal_offset_mask(4, 4, 0), torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("cp", [2, 4])
def test_each_rank_attention_equals_its_shard_of_full_attention(cp):
    """Every rank's queries against the gathered K/V (GQA width) give exactly its shard of
    the full causal attention, and the summed gradients equal the full ones: the mask
    offsets are the global ones."""
    torch.manual_seed(0)
    bsz, seq, heads, kv_heads, dim = 2, 16 * cp, 4, 2, 8
    q = torch.randn(bsz, seq, heads, dim, requires_grad=True)
    k = torch.randn(bsz, seq, kv_heads, dim, requires_grad=True)
    v = torch.randn(bsz, seq, kv_heads, dim, requires_grad=True)
    weight = torch.randn(bsz, seq, heads, dim)
    full = CausalAttention()(q, k, v)
    expected = torch.autograd.grad((full * weight).sum(), (q, k, v))
    loss = 0
    for rank in range(cp):
        out = sharded_causal_attention(shard_sequence(q, cp, rank), k, v, cp, rank)
        diff, where = worst(out.detach(), shard_sequence(full, cp, rank).detach())
        assert diff < 1e-5, f"cp {cp} rank {rank}: worst difference {diff:.3g} at {where}"
        loss = loss + (out * shard_sequence(weight, cp, rank)).sum()
    for name, grad, ref in zip("qkv", torch.autograd.grad(loss, (q, k, v)), expected,
                               strict=True):
        diff, where = worst(grad, ref)
        assert diff < 1e-4, f"cp {cp}: gradient of {name} off by {diff:.3g} at {where}"


@pytest.mark.parametrize("merged", [True, False], ids=["merged-lse", "mask"])
def test_prefix_causal_attention_values_and_gradients(merged):
    """Both ways of attending the last L positions to a longer prefix (CPU: two flash
    attentions merged by log-sum-exp with a hand-written backward; else a mask) against
    an explicit masked softmax, values and gradients."""
    torch.manual_seed(2)
    q = torch.randn(2, 4, 8, 16, requires_grad=True)
    k, v = (torch.randn(2, 4, 24, 16, requires_grad=True) for _ in range(2))
    weight = torch.randn(2, 4, 8, 16)
    scores = (q @ k.transpose(-1, -2)) / 4.0
    allowed = torch.ones(8, 24, dtype=torch.bool).tril(diagonal=16)
    reference = F.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v
    out = prefix_causal_attention(q, k, v, merged=merged)
    diff, where = worst(out.detach(), reference.detach())
    assert diff < 1e-5, f"output off by {diff:.3g} at {where}"
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    expected = torch.autograd.grad((reference * weight).sum(), (q, k, v))
    for name, grad, ref in zip("qkv", grads, expected, strict=True):
        diff, where = worst(grad, ref)
        assert diff < 1e-5, f"gradient of {name} off by {diff:.3g} at {where}"


def test_sdpa_reference_is_causal():
    """The reference the check above trusts: CausalAttention equals an explicit masked
    softmax with the repeated GQA heads."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 8, 4, 4), torch.randn(1, 8, 2, 4), torch.randn(1, 8, 2, 4)
    k2, v2 = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k2) / 2.0
    scores = scores.masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
    expected = torch.einsum("bhqk,bkhd->bqhd", F.softmax(scores, dim=-1), v2)
    diff, where = worst(CausalAttention()(q, k, v), expected)
    assert diff < 1e-5, f"worst difference {diff:.3g} at {where}"


BASE = ["--model", "debug", "--dataset", "random", "--max-steps", "1", "--fp32"]
MISTAKES = {
    "seq-not-divisible": (["--cp", "2", "--seq-len", "66"],
                          "--seq-len 66 is not divisible by 2 x --cp 2 = 4"),
    "cp-0": (["--cp", "0"], "--cp must be >= 1, got 0"),
    "cp-tp-split": (["--cp", "2", "--tp", "4", "--n-kv-heads", "4", "--seq-len", "76"],
                    "--seq-len 76 / --cp 2 = 38 tokens per cp rank is not divisible by --tp 4"),
    "world-size": (["--cp", "2"], "needs world size 1 divisible by dp_replicate 1 x cp 2 x tp "
                   "1 = 2"),
    "world-size-explicit": (["--cp", "2", "--dp-shard", "1"], "mesh dp_replicate 1 x dp_shard "
                            "1 x cp 2 x tp 1 = 2 does not equal world size 1"),
}


@pytest.mark.usefixtures("loom_logger_restored")
@pytest.mark.parametrize(("flags", "message"), list(MISTAKES.values()), ids=list(MISTAKES))
def test_bad_cp_flag_is_one_line_exit_2(tmp_path, capsys, flags, message):
    code = run_train([*BASE, "--outdir", str(tmp_path / "run"), *flags])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], (code, lines)
    assert list(tmp_path.iterdir()) == []

