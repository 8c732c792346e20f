"""`loom plan` adds Muon's Newton-Schulz work to the step time (issue #58 item 3): each
block matrix orthogonalized whole, the work spread over the ranks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import loom.families  # noqa: F401  (registers loom's model families)
from loom.config import parse_args
from loom.models.resolve import plain_model
from loom.plan.muon import iteration_flops, muon_flops_per_rank, newton_schulz_flops
from loom.plan.speed import EFFICIENCY, device_peak, predict_step_time
from loom.plan.trace import fake_world

FLAGS = ["--model", "debug", "--dataset", "random", "--dtype", "bf16"]


def test_one_iteration_counts_the_three_products():
    # X Xᵀ: 2·2·2·3, the polynomial in A: 2·2³, its product with X: 2·2·2·3
    assert iteration_flops(2, 3) == iteration_flops(3, 2) == 24 + 16 + 24


def test_the_model_s_matrices_are_each_counted_whole():
    """The debug model's blocks by hand: wq and wo dim x dim, wk and wv kv x dim, the
    SwiGLU's three hidden x dim; the embedding and head are AdamW's."""
    cfg = parse_args(FLAGS)
    m = cfg.model
    dim, kv = m.dim, m.n_kv_heads * (m.dim // m.n_heads)
    with torch.device("meta"):
        block = next(iter(plain_model(cfg).layers.values()))
    hidden = block.feed_forward.w1.weight.shape[0]
    per_block = (2 * iteration_flops(dim, dim) + 2 * iteration_flops(kv, dim)
                 + 3 * iteration_flops(hidden, dim))
    assert newton_schulz_flops(m, 5) == 5 * m.n_layers * per_block


@pytest.mark.parametrize("world", [1, 4])
def test_the_step_time_grows_by_a_rank_s_share_at_the_iteration_s_precision(tmp_path, world):
    adamw = parse_args(FLAGS)
    muon = replace(adamw, optim=replace(adamw.optim, optimizer="muon"))
    with fake_world(world):
        base = predict_step_time(adamw, world, "H100", tmp_path).compute_s
        more = predict_step_time(muon, world, "H100", tmp_path).compute_s
    assert muon_flops_per_rank(adamw, world) == 0.0
    share = newton_schulz_flops(muon.model, muon.optim.muon_ns_steps) / world
    assert muon_flops_per_rank(muon, world) == share
    bf16_peak, _ = device_peak("H100", torch.bfloat16, tmp_path)
    assert more - base == pytest.approx(share / (bf16_peak * EFFICIENCY), rel=1e-9)
