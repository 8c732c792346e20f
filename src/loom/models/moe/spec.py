"""The mixture-of-experts family: Llama blocks whose feed-forward routes tokens to experts
(DeepSeek-V3 style by default; Qwen3-MoE is one configuration of it)."""

from __future__ import annotations

from dataclasses import fields

from torch import nn

from loom.config import ModelConfig
from loom.models.moe.model import MoE, MoEArgs, MoETransformer
from loom.models.spec import ModelPlan, ModelSpec
from loom.parallel.expert import apply_moe_parallel, moe_layers
from loom.parallel.llama_plan import dense_plan
from loom.parallel.mesh import ParallelDims


def moe_args(m: ModelConfig) -> MoEArgs:
    return MoEArgs(**{f.name: getattr(m, f.name) for f in fields(MoEArgs)})


def moe_plan(model: MoETransformer) -> ModelPlan:
    """The dense plan, then EP/ETP and the MoE TP plan; routed experts get their own dp
    mesh under EP."""
    plan = dense_plan(model)
    dense_tp = plan.tensor_parallel

    def tensor_parallel(dims: ParallelDims, loss_parallel: bool) -> None:
        dense_tp(dims, loss_parallel)
        apply_moe_parallel(model, dims)

    plan.tensor_parallel = tensor_parallel
    plan.experts = [moe.experts for moe in moe_layers(model)]
    return plan


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def moe_block_cost(block: nn.Module) -> float:
    """Parameters a token multiplies in a block: routed experts count by top-k / E."""
    moe = getattr(block, "moe", None)
    if not isinstance(moe, MoE):
        return _count(block)
    experts = _count(moe.experts)
    return _count(block) - experts + experts * moe.top_k / moe.expert_bias.numel()


MOE = ModelSpec(
    name="moe", model_cls=MoETransformer, args_from_config=moe_args, build=MoETransformer,
    plan=moe_plan, block_cost=moe_block_cost,
    description="top-k routed experts (sigmoid or softmax), shared experts, expert bias")
