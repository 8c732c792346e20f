"""Tiny Hugging Face model folders for the HF tests: a config built with `transformers`,
random weights from a fixed seed, and a small byte-level BPE tokenizer trained on the
embedded corpus, saved together as `save_pretrained` would for a hub repo."""

from __future__ import annotations

import gzip
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from loom.data.tokenizers import ASSETS

EOT = "<|endoftext|>"
TOKENIZER_SIZE = 320
MODEL_VOCAB = 328
"""Larger than the tokenizer, as hub models often pad it: the model's own size must win."""

SHAPE = dict(vocab_size=MODEL_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=128)
ARCHITECTURES = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_dropout=0.0, attention_dropout=0.0)),
    "llama31": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=True,
                                    rope_parameters=dict(rope_type="llama3", rope_theta=5e5,
                                                         factor=8.0, low_freq_factor=1.0,
                                                         high_freq_factor=4.0,
                                                         original_max_position_embeddings=32))),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
    "llama_biased": ("LlamaConfig", dict(num_key_value_heads=2, attention_bias=True,
                                         mlp_bias=True, hidden_act="gelu",
                                         rope_parameters=dict(rope_type="linear",
                                                              rope_theta=1e4, factor=2.0))),
    "qwen3_sliding": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=16,
                                          use_sliding_window=True, sliding_window=16,
                                          max_window_layers=1, tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_key_value_heads=2, head_dim=8, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=16,
                                         norm_topk_prob=True, tie_word_embeddings=False)),
}
"""Native families serve llama, llama31 (RoPE scaling, tied), qwen3 and qwen3_moe; qwen2 and
gpt_neox take transformers' path, and so do llama_biased (biases, gelu, linear RoPE scaling)
and qwen3_sliding (sliding-window attention) under `--model-impl auto`: features loom's
families do not have."""


def corpus_sample(chars: int = 60_000) -> str:
    """The opening of the embedded Austen text."""
    with gzip.open(ASSETS / "corpus" / "austen.txt.gz", "rt", encoding="utf-8") as f:
        return f.read(chars)


def save_tokenizer(folder: Path, text: str) -> None:
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_SIZE, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT).save_pretrained(folder)


def save_tiny_model(folder: Path, arch: str, seed: int = 0, tokenizer: bool = True) -> Path:
    """A `save_pretrained` folder of a 2-block model of `arch` with its tokenizer (none
    without `tokenizer`, as weights-only Hub folders ship)."""
    import transformers

    config_class, extra = ARCHITECTURES[arch]
    return save_model(folder, getattr(transformers, config_class)(**SHAPE, **extra), seed,
                      tokenizer)


def save_model(folder: Path, config, seed: int = 0, tokenizer: bool = True) -> Path:
    """A `save_pretrained` folder of transformers' causal LM of `config`, seeded, its norms
    moved off their init, with the corpus tokenizer unless `tokenizer` is False."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms start at ones: a wrong permutation of them would not show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(folder)
    if tokenizer:
        save_tokenizer(folder, corpus_sample())
    return folder
