"""The mixture-of-experts family: Llama blocks whose feed-forward routes tokens to experts
(DeepSeek-V3 style by default; Qwen3-MoE is one configuration of it)."""

from __future__ import annotations

from dataclasses import fields

from torch import nn

from loom.config import ModelConfig
from loom.models.llama.flags import LlamaFlags
from loom.models.llama.spec import PARTS, rope_input
from loom.models.llama.uses import LLAMA_USES
from loom.models.moe.balance import balance_loss_metric, moe_layers, update_expert_bias
from loom.models.moe.flags import MoEFlags
from loom.models.moe.model import (
    MoE,
    MoEArgs,
    MoETransformer,
    active_param_count,
    weigh_balance_loss,
)
from loom.models.moe.presets import PRESETS
from loom.models.qwen3.flags import Qwen3Flags
from loom.models.spec import ModelSpec, Routing, SpecHook


def moe_args(m: ModelConfig) -> MoEArgs:
    values = m.values()  # the shared flags, Llama's, Qwen3's and the MoE family's own
    return MoEArgs(**{f.name: values[f.name] for f in fields(MoEArgs)})


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def moe_block_cost(block: nn.Module) -> float:
    """Parameters a token multiplies in a block: routed experts count by top-k / E."""
    moe = getattr(block, "moe", None)
    if not isinstance(moe, MoE):
        return _count(block)
    experts = _count(moe.experts)
    return _count(block) - experts + experts * moe.top_k / moe.expert_bias.numel()


def router_gates(model: nn.Module) -> list[nn.Module]:
    return [layer.router.gate for layer in moe_layers(model)]


MOE_USES = LLAMA_USES | {"n_experts", "top_k", "n_shared_experts", "moe_hidden_dim",
                         "n_dense_layers", "score_func", "route_norm", "route_scale",
                         "load_balance_coeff", "aux_loss_coeff"}
"""Llama's blocks' flags and the routed feed-forward's."""

EXPERT_BIAS = SpecHook("moe-expert-bias", update_expert_bias,
                       token_sums=("tokens_per_expert",))
BALANCE_LOSS = SpecHook("moe-balance-loss", balance_loss_metric, stages=True)
"""Apart from the expert-bias hook, whose counts are per layer (their shapes differ between
pipeline stages): the balance loss is one number, summed over the stages too."""

def routing(args: MoEArgs) -> Routing | None:
    """The routed shape (None where --n-experts 0 leaves every block dense)."""
    if not args.n_experts:
        return None
    return Routing(args.n_experts, args.top_k, min(args.n_dense_layers, args.n_layers))


MOE = ModelSpec(
    name="moe", model_cls=MoETransformer, args_from_config=moe_args, build=MoETransformer,
    flex_doc_mask=True, weigh_own_losses=weigh_balance_loss,
    args_cls=MoEArgs, parts=PARTS, block_cost=moe_block_cost, block_inputs=rope_input,
    routers=router_gates, active_params=active_param_count,
    routing=routing, hooks=(EXPERT_BIAS, BALANCE_LOSS),
    flags=(LlamaFlags, Qwen3Flags, MoEFlags), presets=PRESETS, uses=MOE_USES,
    description="top-k routed experts (sigmoid or softmax), shared experts, expert bias")
