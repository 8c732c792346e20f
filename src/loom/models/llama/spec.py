"""The Llama family: loom's dense decoder, and Hugging Face Llama checkpoints natively."""

from __future__ import annotations

from dataclasses import fields

import torch

from loom.config import ModelConfig
from loom.models.llama.flags import LlamaFlags
from loom.models.llama.hf import LlamaAdapter
from loom.models.llama.model import ModelArgs, Transformer
from loom.models.llama.presets import ALIASES, PRESETS
from loom.models.llama.uses import LLAMA_USES
from loom.models.qwen3.flags import Qwen3Flags
from loom.models.spec import ModelParts, ModelSpec


def dense_args(m: ModelConfig) -> ModelArgs:
    """Every field from the model flag of the same name, shared or a family's (never
    copied by hand)."""
    values = m.values()
    return ModelArgs(**{f.name: values[f.name] for f in fields(ModelArgs)})


def rope_input(model: Transformer) -> tuple[torch.Tensor]:
    """Each block takes the RoPE table after the hidden states."""
    return (model.rope,)


LORA_TARGETS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
"""Every attention and MLP projection: what LoRA adapts by default (QLoRA's choice)."""

PARTS = ModelParts(embedding="tok_embeddings", blocks="layers", head=("norm", "output"),
                   output="output", attention="attention", attention_core="attention.core",
                   feed_forward=("feed_forward", "moe"))
"""The Transformer's parts as loom's families built on it name them (MoE's blocks hold
`moe` where a dense block holds `feed_forward`)."""

LLAMA = ModelSpec(
    name="llama", model_cls=Transformer, args_from_config=dense_args, build=Transformer,
    flex_doc_mask=True,
    args_cls=ModelArgs, parts=PARTS, block_inputs=rope_input, hf=(LlamaAdapter(),),
    lora_targets=LORA_TARGETS,
    flags=(LlamaFlags, Qwen3Flags), presets=PRESETS, aliases=ALIASES, uses=LLAMA_USES,
    description="GQA attention with RoPE (Llama 3.1 scaling), SwiGLU, RMSNorm")
