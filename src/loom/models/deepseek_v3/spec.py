"""The DeepSeek-V3 family's spec: its arguments from a preset, a Hugging Face folder or the
shared flags; the MoE family's expert accounting and bias-balancing hook; its MTP depths."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loom.config import ConfigError, ModelConfig
from loom.models.deepseek_v3.args import MLA_FIELDS, SHAPES, DeepseekV3Args, derived
from loom.models.deepseek_v3.flags import DeepseekV3Flags
from loom.models.deepseek_v3.hf import DeepseekV3Adapter, mla_fields
from loom.models.deepseek_v3.model import DeepseekV3
from loom.models.hf_folder import CONFIG, read_config
from loom.models.llama.flags import LlamaFlags
from loom.models.llama.spec import rope_input
from loom.models.moe.counts import per_token_param_count
from loom.models.moe.flags import MoEFlags
from loom.models.moe.spec import BALANCE_LOSS, EXPERT_BIAS, moe_block_cost, router_gates
from loom.models.qwen3.flags import Qwen3Flags
from loom.models.spec import NO_DEPTHS, Depths, ModelParts, ModelSpec
from loom.models.transformers.model import hf_source


def source_fields(m: ModelConfig) -> dict[str, Any]:
    """The family's own fields where the model's shape comes from: a Hugging Face folder,
    a preset's `SHAPES` row, or DeepSeek-V3's proportions of --dim and --n-heads."""
    if m.from_hub_format:
        source = Path(hf_source(m.model, probe=False))
        if not source.is_dir():  # a hub id: resolving it fetched its config.json
            from huggingface_hub import hf_hub_download  # optional: only hub ids reach here

            return mla_fields(read_config(Path(hf_hub_download(str(source), CONFIG))))
        return mla_fields(read_config(source / CONFIG))
    if m.model in SHAPES:
        return SHAPES[m.model]
    return derived(m.dim, m.n_heads)


def own_fields(m: ModelConfig) -> dict[str, Any]:
    """The family's own fields: its source's, overridden by the flags a user set."""
    return {**source_fields(m), **m.flags_of(DeepseekV3Flags).set_values()}


def deepseek_v3_args(m: ModelConfig) -> DeepseekV3Args:
    """The shared flags' values and the family's own fields; sizes it cannot be built with
    are a configuration error (one line), as validation reports the shared flags'."""
    values = m.values()  # the shared flags, Llama's, Qwen3's and MoE's
    shared = {f.name: values[f.name] for f in fields(DeepseekV3Args) if f.name not in MLA_FIELDS}
    try:
        return DeepseekV3Args(**shared, **own_fields(m))
    except ValueError as e:
        raise ConfigError(f"--family deepseek-v3: {e}") from None


def active_params(args: DeepseekV3Args) -> int:
    """Parameters one token multiplies through, without the MTP modules (DeepSeek's 37B
    counts none; `per_token_param_count` says what else it counts)."""
    with torch.device("meta"):
        model = DeepseekV3(DeepseekV3Args(**{**vars(args), "mtp_layers": 0}))
    return per_token_param_count(model, args.top_k, args.n_experts)


def mtp_depths(model: nn.Module) -> Depths:
    """The MTP modules as extra prediction depths, reported as `mtp/loss` (the mean over
    depths of each depth's loss, over the step's valid tokens as the main loss is)."""
    args = model.args
    return Depths(args.mtp_layers, args.mtp_loss_weight, "mtp/loss") if args.mtp_layers \
        else NO_DEPTHS


LORA_TARGETS = ("attention.wq", "attention.wq_b", "attention.wkv_b", "attention.wo",
                "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
"""The per-head projections (the low-rank down-projections stay whole) and the dense
SwiGLU; routed experts are stacked weights, not linears."""

DEEPSEEK_V3 = ModelSpec(
    name="deepseek-v3", model_cls=DeepseekV3, args_from_config=deepseek_v3_args,
    build=DeepseekV3, args_cls=DeepseekV3Args, parts=ModelParts(head=("norm", "output", "mtp")),
    block_cost=moe_block_cost, block_inputs=rope_input, routers=router_gates,
    active_params=active_params, hf=(DeepseekV3Adapter(),), lora_targets=LORA_TARGETS,
    hooks=(EXPERT_BIAS, BALANCE_LOSS), depths=mtp_depths,
    flags=(LlamaFlags, Qwen3Flags, MoEFlags, DeepseekV3Flags),
    description="multi-head latent attention, group-limited sigmoid routing with shared "
                "experts and expert bias, YaRN, multi-token prediction")
