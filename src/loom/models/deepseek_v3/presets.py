"""DeepSeek-V3's presets: the debug sizes the tests train, DeepSeek-V3 and Moonlight by shape."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v3-debug": dict(family="deepseek-v3", dim=64, n_layers=3, n_heads=4,
                              n_kv_heads=4, hidden_dim=128, n_experts=8, top_k=2,
                              n_shared_experts=1, moe_hidden_dim=32, n_dense_layers=1,
                              route_scale=2.5, seq_len=128, batch_size=1,
                              load_balance_coeff=1e-2, warmup_steps=20,
                              q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                              qk_rope_head_dim=16, v_head_dim=16, n_group=2, topk_group=1),
    "deepseek-v3": dict(family="deepseek-v3", dim=7168, n_layers=61, n_heads=128,
                        n_kv_heads=128, vocab_size=129280, hidden_dim=18432, n_experts=256,
                        top_k=8, n_shared_experts=1, moe_hidden_dim=2048, n_dense_layers=3,
                        route_scale=2.5, norm_eps=1e-6, max_seq_len=163840, seq_len=4096,
                        batch_size=1, q_lora_rank=1536, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_group=8,
                        topk_group=4, yarn_factor=40.0, yarn_original_max_seq_len=4096,
                        yarn_mscale=1.0, yarn_mscale_all_dim=1.0),
    "moonlight-16b": dict(family="deepseek-v3", dim=2048, n_layers=27, n_heads=16,
                          n_kv_heads=16, vocab_size=163840, hidden_dim=11264, n_experts=64,
                          top_k=6, n_shared_experts=2, moe_hidden_dim=1408, n_dense_layers=1,
                          route_scale=2.446, rope_theta=50000.0, max_seq_len=8192,
                          seq_len=4096, batch_size=1, q_lora_rank=0, kv_lora_rank=512,
                          qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                          n_group=1, topk_group=1),
}
"""Preset name -> every flag it sets, the MLA widths, routing groups, YaRN and MTP settings
included: one complete row each."""

PRESETS["deepseek-v3-mtp-debug"] = {**PRESETS["deepseek-v3-debug"], "mtp_layers": 1}
"""The debug model with one multi-token prediction module."""
