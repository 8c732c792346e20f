"""The Qwen3 families: loom's Llama with per-head q/k RMSNorm, and loom's mixture of experts
configured as Qwen3-MoE routes. Nothing here but the configuration and the Hugging Face
adapters: the modules, parallel plans and init are the Llama and MoE families' own."""

from __future__ import annotations

from dataclasses import replace

from loom.config import ModelConfig
from loom.models.llama.model import ModelArgs, Transformer
from loom.models.llama.spec import LORA_TARGETS, dense_args
from loom.models.moe.model import MoEArgs, MoETransformer
from loom.models.moe.spec import moe_args, moe_block_cost, moe_plan
from loom.models.qwen3.hf import Qwen3Adapter, Qwen3MoeAdapter
from loom.models.spec import ModelSpec
from loom.parallel.llama_plan import dense_plan


def qwen3_args(m: ModelConfig) -> ModelArgs:
    return replace(dense_args(m), qk_norm=True)


def qwen3_moe_args(m: ModelConfig) -> MoEArgs:
    return replace(moe_args(m), qk_norm=True)


QWEN3 = ModelSpec(
    name="qwen3", model_cls=Transformer, args_from_config=qwen3_args, build=Transformer,
    plan=dense_plan, hf=(Qwen3Adapter(),), lora_targets=LORA_TARGETS,
    description="Llama with per-head q/k RMSNorm and an explicit head width")

QWEN3_MOE = ModelSpec(
    name="qwen3-moe", model_cls=MoETransformer, args_from_config=qwen3_moe_args,
    build=MoETransformer, plan=moe_plan, block_cost=moe_block_cost, hf=(Qwen3MoeAdapter(),),
    description="loom's MoE with softmax top-k routing, q/k norm, no shared experts")
