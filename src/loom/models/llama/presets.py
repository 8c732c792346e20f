"""The Llama family's presets: loom's own sizes (`debug` to `xxxl`), the agpt recipes and the
Hub's Llama checkpoints by shape (plan them offline; train them with `--model <their
folder>`, which fills these fields from its config.json)."""

from __future__ import annotations

from typing import Any

SIZE_FLAGS = ("dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of", "seq_len", "batch_size")
SIZES: dict[str, tuple[int, ...]] = {  # loom's own sizes: one value per flag of SIZE_FLAGS
    "debug": (128, 4, 4, 2, 128, 256, 1),
    "s": (768, 12, 12, 4, 256, 2048, 4),
    "m": (1024, 16, 16, 4, 256, 2048, 4),
    "l": (1536, 16, 16, 4, 256, 2048, 2),
    "xl": (2048, 24, 32, 8, 256, 2048, 1),
    "xxl": (4096, 32, 32, 8, 256, 4096, 1),
    "xxxl": (5120, 40, 40, 8, 256, 4096, 1),
}

PRESETS: dict[str, dict[str, Any]] = {
    **{name: dict(zip(SIZE_FLAGS, row, strict=True)) for name, row in SIZES.items()},
    "agpt-2b": dict(dim=2048, n_layers=12, n_heads=16, n_kv_heads=4, multiple_of=256,
                    vocab_size=256128, hidden_dim=11008, rope_theta=50000.0,
                    seq_len=8192, batch_size=1),
    "agpt-20b": dict(dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, multiple_of=1024,
                     vocab_size=256128, hidden_dim=14336, rope_theta=500000.0,
                     seq_len=2048, batch_size=1),
    "llama-3.2-1b": dict(family="llama", dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                         hidden_dim=8192, vocab_size=128256, rope_theta=500000.0,
                         rope_factor=32.0, tie_embeddings=True, max_seq_len=131072,
                         seq_len=2048, batch_size=1),
    "llama-3.1-8b": dict(family="llama", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         hidden_dim=14336, vocab_size=128256, rope_theta=500000.0,
                         rope_factor=8.0, max_seq_len=131072, seq_len=8192, batch_size=1),
}
"""Preset name -> every flag it sets (a row is complete: nothing else fills a preset)."""

ALIASES: dict[str, str] = {
    "small": "s", "medium": "m", "large": "l",
    "xlarge": "xl", "extra-large": "xl",
    "xxlarge": "xxl", "extra-extra-large": "xxl",
    "xxxlarge": "xxxl", "extra-extra-extra-large": "xxxl",
    "agpt2b": "agpt-2b", "agpt_2b": "agpt-2b", "AGPT-2B": "agpt-2b",
    "agpt20b": "agpt-20b", "agpt_20b": "agpt-20b", "AGPT-20B": "agpt-20b",
}
"""The other names users type for these presets."""
