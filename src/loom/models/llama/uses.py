"""The model flags loom's Llama blocks read (`ModelSpec.uses`; `loom.config.uses` refuses
the others): the shape, the SwiGLU width's derivation, RoPE with Llama 3.1's scaling, and
Qwen3's head width and q/k norm. `--tie-embeddings` is no flag of theirs: a fresh model's
two tensors are drawn apart, so only a source's tie (an import's config.json) means
anything, and that is read from the source."""

from __future__ import annotations

SHAPE = frozenset({"dim", "n_layers", "n_heads", "vocab_size", "max_seq_len"})
"""What every loom family (the tests' GPT-2 too) is sized by."""

SWIGLU = frozenset({"multiple_of", "ffn_dim_multiplier", "hidden_dim"})
"""The dense feed-forward's width: given, or derived from --dim."""

LLAMA_ROPE = frozenset({"rope_theta", "rope_factor", "rope_low_freq_factor",
                        "rope_high_freq_factor", "rope_original_max_seq_len"})

LLAMA_USES = SHAPE | SWIGLU | LLAMA_ROPE | {"norm_eps", "n_kv_heads", "head_dim", "qk_norm"}
