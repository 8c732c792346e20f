"""Model presets: one table, every field a preset may set, and the aliases users type."""

from __future__ import annotations

PRESETS: dict[str, dict[str, int | float | str | bool]] = {
    "debug": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, multiple_of=128,
                  seq_len=256, batch_size=1),
    "s": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, multiple_of=256,
              seq_len=2048, batch_size=4),
    "m": dict(dim=1024, n_layers=16, n_heads=16, n_kv_heads=4, multiple_of=256,
              seq_len=2048, batch_size=4),
    "l": dict(dim=1536, n_layers=16, n_heads=16, n_kv_heads=4, multiple_of=256,
              seq_len=2048, batch_size=2),
    "xl": dict(dim=2048, n_layers=24, n_heads=32, n_kv_heads=8, multiple_of=256,
               seq_len=2048, batch_size=1),
    "xxl": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, multiple_of=256,
                seq_len=4096, batch_size=1),
    "xxxl": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, multiple_of=256,
                 seq_len=4096, batch_size=1),
    "agpt-2b": dict(dim=2048, n_layers=12, n_heads=16, n_kv_heads=4, multiple_of=256,
                    vocab_size=256128, hidden_dim=11008, rope_theta=50000.0,
                    seq_len=8192, batch_size=1),
    "agpt-20b": dict(dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, multiple_of=1024,
                     vocab_size=256128, hidden_dim=14336, rope_theta=500000.0,
                     seq_len=2048, batch_size=1),
    # Mixture of experts (DeepSeek-V3 style; n_experts > 0 selects models/moe.py).
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
    # DeepSeek-V3 (multi-head latent attention; its own fields: models/deepseek_v3/args.py).
    "deepseek-v3-debug": dict(family="deepseek-v3", dim=64, n_layers=3, n_heads=4,
                              n_kv_heads=4, hidden_dim=128, n_experts=8, top_k=2,
                              n_shared_experts=1, moe_hidden_dim=32, n_dense_layers=1,
                              route_scale=2.5, seq_len=128, batch_size=1,
                              load_balance_coeff=1e-2, warmup_steps=20),
    "deepseek-v3-mtp-debug": dict(family="deepseek-v3", dim=64, n_layers=3, n_heads=4,
                                  n_kv_heads=4, hidden_dim=128, n_experts=8, top_k=2,
                                  n_shared_experts=1, moe_hidden_dim=32, n_dense_layers=1,
                                  route_scale=2.5, seq_len=128, batch_size=1,
                                  load_balance_coeff=1e-2, warmup_steps=20),
    "deepseek-v3": dict(family="deepseek-v3", dim=7168, n_layers=61, n_heads=128,
                        n_kv_heads=128, vocab_size=129280, hidden_dim=18432, n_experts=256,
                        top_k=8, n_shared_experts=1, moe_hidden_dim=2048, n_dense_layers=3,
                        route_scale=2.5, norm_eps=1e-6, max_seq_len=163840, seq_len=4096,
                        batch_size=1),
    "moonlight-16b": dict(family="deepseek-v3", dim=2048, n_layers=27, n_heads=16,
                          n_kv_heads=16, vocab_size=163840, hidden_dim=11264, n_experts=64,
                          top_k=6, n_shared_experts=2, moe_hidden_dim=1408, n_dense_layers=1,
                          route_scale=2.446, rope_theta=50000.0, max_seq_len=8192,
                          seq_len=4096, batch_size=1),
    # The Hub's checkpoints people start from, by shape (plan them offline; train them
    # with --model <their folder>, which fills these fields from its config.json).
    "llama-3.2-1b": dict(family="llama", dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                         hidden_dim=8192, vocab_size=128256, rope_theta=500000.0,
                         rope_factor=32.0, tie_embeddings=True, max_seq_len=131072,
                         seq_len=2048, batch_size=1),
    "llama-3.1-8b": dict(family="llama", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         hidden_dim=14336, vocab_size=128256, rope_theta=500000.0,
                         rope_factor=8.0, max_seq_len=131072, seq_len=8192, batch_size=1),
    "qwen3-0.6b": dict(family="qwen3", dim=1024, n_layers=28, n_heads=16, n_kv_heads=8,
                       head_dim=128, qk_norm=True, hidden_dim=3072, vocab_size=151936,
                       rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True,
                       max_seq_len=40960, seq_len=4096, batch_size=1),
    "qwen3-30b-a3b": dict(family="qwen3-moe", dim=2048, n_layers=48, n_heads=32,
                          n_kv_heads=4, head_dim=128, qk_norm=True, hidden_dim=6144,
                          vocab_size=151936, rope_theta=1000000.0, norm_eps=1e-6,
                          n_experts=128, top_k=8, n_shared_experts=0, moe_hidden_dim=768,
                          n_dense_layers=0, score_func="softmax", route_norm=True,
                          load_balance_coeff=0.0, max_seq_len=40960, seq_len=4096,
                          batch_size=1),
}

ALIASES: dict[str, str] = {
    "small": "s", "medium": "m", "large": "l",
    "xlarge": "xl", "extra-large": "xl",
    "xxlarge": "xxl", "extra-extra-large": "xxl",
    "xxxlarge": "xxxl", "extra-extra-extra-large": "xxxl",
    "agpt2b": "agpt-2b", "agpt_2b": "agpt-2b", "AGPT-2B": "agpt-2b",
    "agpt20b": "agpt-20b", "agpt_20b": "agpt-20b", "AGPT-20B": "agpt-20b",
}


def is_hf_model(name: str) -> bool:
    """A name with a slash (or a local folder) selects the Hugging Face path, not a preset."""
    return "/" in name


def resolve_preset(name: str) -> tuple[str, dict[str, int | float | str | bool]]:
    """Return the canonical preset name and its fields; raise ValueError listing the choices."""
    canonical = ALIASES.get(name, name)
    if canonical not in PRESETS:
        choices = ", ".join([*PRESETS, *ALIASES])
        raise ValueError(f"unknown model preset {name!r}; choose one of: {choices}")
    return canonical, PRESETS[canonical]
