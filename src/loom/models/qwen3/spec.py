"""The Qwen3 families: loom's Llama with per-head q/k RMSNorm, and loom's mixture of experts
configured as Qwen3-MoE routes. Nothing here but the configuration and the Hugging Face
adapters: the modules, parallel plans and init are the Llama and MoE families' own."""

from __future__ import annotations

from dataclasses import replace

from loom.config import ModelConfig
from loom.models.llama.flags import LlamaFlags
from loom.models.llama.model import ModelArgs, Transformer
from loom.models.llama.spec import LORA_TARGETS, PARTS, dense_args, rope_input
from loom.models.llama.uses import LLAMA_USES
from loom.models.moe.model import MoEArgs
from loom.models.moe.spec import MOE, MOE_USES
from loom.models.qwen3.flags import Qwen3Flags
from loom.models.qwen3.hf import Qwen3Adapter, Qwen3MoeAdapter
from loom.models.qwen3.presets import QWEN3_MOE_PRESETS, QWEN3_PRESETS
from loom.models.spec import ModelSpec


def qwen3_args(m: ModelConfig) -> ModelArgs:
    return replace(dense_args(m), qk_norm=True)  # always: --qk-norm is refused (uses)


def qwen3_moe_args(m: ModelConfig) -> MoEArgs:
    return replace(MOE.args_from_config(m), qk_norm=True)


QWEN3 = ModelSpec(
    name="qwen3", model_cls=Transformer, args_from_config=qwen3_args, build=Transformer,
    flex_doc_mask=True,
    args_cls=ModelArgs, parts=PARTS, block_inputs=rope_input, hf=(Qwen3Adapter(),),
    lora_targets=LORA_TARGETS,
    flags=(LlamaFlags, Qwen3Flags), presets=QWEN3_PRESETS, uses=LLAMA_USES - {"qk_norm"},
    description="Llama with per-head q/k RMSNorm and an explicit head width")

QWEN3_MOE = replace(
    MOE, name="qwen3-moe", args_from_config=qwen3_moe_args, hf=(Qwen3MoeAdapter(),),
    presets=QWEN3_MOE_PRESETS,
    uses=MOE_USES - {"qk_norm"},
    description="loom's MoE with softmax top-k routing, q/k norm, no shared experts")
