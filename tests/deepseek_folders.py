"""Tiny DeepseekV3ForCausalLM folders built with transformers' own classes: 3 layers (one
dense), 8 routed experts in 2 groups (one chosen per token), a query bottleneck, YaRN."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.hf_models import MODEL_VOCAB, save_model

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
            original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0,
            mscale=0.707, mscale_all_dim=1.0)
SHAPE = dict(vocab_size=MODEL_VOCAB, hidden_size=32, intermediate_size=64,
             moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
             num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
             q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
             v_head_dim=8, routed_scaling_factor=2.5, max_position_embeddings=128,
             tie_word_embeddings=False, rope_parameters=YARN)


def save_deepseek(folder: Path, seed: int = 0, tokenizer: bool = True, **changes) -> Path:
    """A `save_pretrained` folder of the tiny model (`changes` override the shape)."""
    import transformers

    return save_model(folder, transformers.DeepseekV3Config(**{**SHAPE, **changes}), seed,
                      tokenizer)


def bias_routing(folder: Path, seed: int = 1) -> None:
    """Give every routing bias (`e_score_correction_bias`) a value large enough to change
    which experts tokens pick, as a trained checkpoint's have."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for name in tensors:
        if name.endswith("e_score_correction_bias"):
            tensors[name] = torch.randn(tensors[name].shape, generator=gen) * 0.3
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
