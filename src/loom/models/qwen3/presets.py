"""Qwen3's presets: the Hub's checkpoints by shape (train them with `--model <their folder>`)."""

from __future__ import annotations

from typing import Any

QWEN3_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(family="qwen3", dim=1024, n_layers=28, n_heads=16, n_kv_heads=8,
                       head_dim=128, qk_norm=True, hidden_dim=3072, vocab_size=151936,
                       rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True,
                       max_seq_len=40960, seq_len=4096, batch_size=1),
}
"""Dense Qwen3 presets: name -> every flag it sets."""

QWEN3_MOE_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": dict(family="qwen3-moe", dim=2048, n_layers=48, n_heads=32,
                          n_kv_heads=4, head_dim=128, qk_norm=True, hidden_dim=6144,
                          vocab_size=151936, rope_theta=1000000.0, norm_eps=1e-6,
                          n_experts=128, top_k=8, n_shared_experts=0, moe_hidden_dim=768,
                          n_dense_layers=0, score_func="softmax", route_norm=True,
                          load_balance_coeff=0.0, max_seq_len=40960, seq_len=4096,
                          batch_size=1),
}
"""Qwen3-MoE presets: name -> every flag it sets."""
