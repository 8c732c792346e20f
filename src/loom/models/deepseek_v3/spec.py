"""The DeepSeek-V3 family's spec: its arguments from a preset, a Hugging Face folder or the
shared flags; the MoE family's expert accounting and bias-balancing hook; its MTP depths."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import torch
from torch import nn

from loom.config import ConfigError, ModelConfig
from loom.models.deepseek_v3.args import MLA_FIELDS, DeepseekV3Args, derived
from loom.models.deepseek_v3.flags import DeepseekV3Flags
from loom.models.deepseek_v3.hf import DeepseekV3Adapter
from loom.models.deepseek_v3.model import DeepseekV3
from loom.models.deepseek_v3.presets import PRESETS
from loom.models.llama.flags import LlamaFlags
from loom.models.llama.spec import PARTS, rope_input
from loom.models.llama.uses import LLAMA_USES, SHAPE, SWIGLU
from loom.models.moe.counts import per_token_param_count
from loom.models.moe.flags import MoEFlags
from loom.models.moe.model import weigh_balance_loss
from loom.models.moe.spec import (
    BALANCE_LOSS,
    EXPERT_BIAS,
    MOE_USES,
    moe_block_cost,
    router_gates,
    routing,
)
from loom.models.qwen3.flags import Qwen3Flags
from loom.models.spec import NO_DEPTHS, Depths, ModelSpec


def own_fields(m: ModelConfig) -> dict[str, Any]:
    """The family's own fields: DeepSeek-V3's proportions of --dim and --n-heads, overridden
    by every flag set (by the preset's row, a Hugging Face folder's config.json when the run
    was resolved, or the user). No file is read: the config holds every fact."""
    return {**derived(m.dim, m.n_heads), **m.flags_of(DeepseekV3Flags).set_values()}


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


DEEPSEEK_V3_USES = (SHAPE | SWIGLU | {"norm_eps", "rope_theta"}
                    | {f.name for f in fields(DeepseekV3Flags)}
                    | (MOE_USES - LLAMA_USES - {"score_func"}))
"""Latent attention has its own widths (no --n-kv-heads, --head-dim or --qk-norm) and YaRN
in place of Llama 3.1's RoPE scaling; the group-limited router scores by sigmoid only, as
DeepSeek-V3 does (no --score-func). The dense blocks' SwiGLU is Llama's."""

LORA_TARGETS = ("attention.wq", "attention.wq_b", "attention.wkv_b", "attention.wo",
                "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
"""The per-head projections (the low-rank down-projections stay whole) and the dense
SwiGLU; routed experts are stacked weights, not linears."""

LAYOUTS = (
    "ep", "tp", "pp-1f1b", "ep (4 ranks)", "tp + ep", "tp + ep + etp", "dp_shard",
    "pp-1f1b + ep", "pp-interleaved-1f1b", "pp-zero-bubble", "pp-dualpipev", "cp",
    "simple-fsdp + ep", "ep + block ac + compile", "tp + ep + op ac + compile",
    "tp + ep + etp + block ac + compile", "float8 + ep", "float8 + dp_shard + tp", "MTP + ep",
    "MTP + tp", "MTP + tp + ep", "MTP + pp-1f1b", "MTP + pp-interleaved-1f1b",
    "MTP + pp-1f1b + tp", "MTP + cp", "MTP + cp + dp_shard", "dp_replicate + dp_shard",
    "LoRA + dp_shard", "Hugging Face folder, tp + ep", "MTP + pp-1f1b + cp",
    "MTP + pp-zero-bubble", "MTP + pp-dualpipev", "MTP + pp-dualpipev + cp",
    "MTP + fused-linear + dp_shard", "MTP + chunked + dp_shard", "MTP + loss-parallel + tp",
    "MTP + doc-mask + cp", "MTP + fused-linear + tp", "MTP + doc-mask + fused-linear + tp",
)
"""The layouts run on DeepSeek-V3's own modules (latent attention, grouped routing, MTP), each
matching one process."""

REFUSALS = (
    "multi-token prediction with `--doc-mask` under `--pp` (`DeepseekV3Flags.check`): its "
    "first stage's forward fails at the second step, not yet understood",
)
"""What the family refuses in one line, and why."""

DEEPSEEK_V3 = ModelSpec(
    name="deepseek-v3", model_cls=DeepseekV3, args_from_config=deepseek_v3_args,
    flex_doc_mask=True, weigh_own_losses=weigh_balance_loss,
    build=DeepseekV3, args_cls=DeepseekV3Args, parts=replace(PARTS, head=(*PARTS.head, "mtp")),
    block_cost=moe_block_cost, block_inputs=rope_input, routers=router_gates,
    active_params=active_params, routing=routing, hf=(DeepseekV3Adapter(),),
    lora_targets=LORA_TARGETS, hooks=(EXPERT_BIAS, BALANCE_LOSS), depths=mtp_depths,
    flags=(LlamaFlags, Qwen3Flags, MoEFlags, DeepseekV3Flags), presets=PRESETS,
    layouts=LAYOUTS, refusals=REFUSALS, uses=DEEPSEEK_V3_USES,
    description="multi-head latent attention, group-limited sigmoid routing with shared "
                "experts and expert bias, YaRN, multi-token prediction")
