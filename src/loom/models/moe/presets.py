"""The MoE family's presets (DeepSeek-style routing with loom's attention; `n_experts > 0`
selects the family)."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "moe-debug": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, multiple_of=128,
                      n_experts=8, top_k=2, n_shared_experts=1, moe_hidden_dim=128,
                      n_dense_layers=1, seq_len=256, batch_size=1,
                      load_balance_coeff=1e-2, warmup_steps=20),  # lr 3e-3 moves routers fast
    "moe-16b": dict(dim=2048, n_layers=27, n_heads=16, n_kv_heads=4, vocab_size=102400,
                    hidden_dim=10944, n_experts=64, top_k=6, n_shared_experts=2,
                    moe_hidden_dim=1408, n_dense_layers=1, score_func="softmax",
                    route_norm=False, seq_len=4096, batch_size=1),  # 15.6B total, 2.6B active
    "moe-671b": dict(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, vocab_size=129280,
                     hidden_dim=18432, n_experts=256, top_k=8, n_shared_experts=1,
                     moe_hidden_dim=2048, n_dense_layers=3, route_scale=2.5,
                     seq_len=4096, batch_size=1),  # DeepSeek-V3 shape: 672B total, 38.7B active
}
"""Preset name -> every flag it sets."""
