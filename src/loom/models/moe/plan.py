"""The MoE family's parallel plan: the dense (Llama) plan, then EP/ETP and the MoE TP plan
on every MoE block, routed experts on their own dp mesh under EP.

A family plan: it names the MoE model's modules, as models/llama/plan.py names Llama's;
the generic EP machinery (placements, token dispatch) is parallel/expert.py's.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInputOutput,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Placement

from loom.models.llama.plan import dense_plan
from loom.models.moe.aux_loss import SequenceSum
from loom.models.moe.balance import moe_layers
from loom.models.moe.model import ExpertWeights, MoE, MoETransformer
from loom.models.spec import ModelPlan
from loom.parallel.expert import WEIGHTS, TokenDispatcher, expert_placements, sum_grad_over
from loom.parallel.mesh import ParallelDims

logger = logging.getLogger("loom")


def moe_plan(model: MoETransformer) -> ModelPlan:
    """The dense plan, then EP/ETP and the MoE TP plan; routed experts get their own dp
    mesh under EP."""
    plan = dense_plan(model)
    dense_tp = plan.tensor_parallel

    def tensor_parallel(dims: ParallelDims, loss_parallel: bool) -> None:
        dense_tp(dims, loss_parallel)
        apply_moe_parallel(model, dims)

    plan.tensor_parallel = tensor_parallel
    plan.context_parallel = partial(complete_sequences, model)
    plan.experts = [moe.experts for moe in moe_layers(model)]
    return plan


def complete_sequences(model: nn.Module, summed: SequenceSum) -> None:
    """Under context parallel: every MoE layer sums its balance loss's per-sequence sums
    with `summed` (over the cp ranks, with gradient) before forming the loss."""
    for moe in moe_layers(model):
        moe.sequence_sum = summed


class LocalExpertWeights(ExpertWeights):
    """The sharded (DTensor) expert weights as this rank's local tensors; `grad_placements`
    says how each local gradient relates to the whole."""

    def __init__(self, grad_placements: list[list[Placement]]):
        super().__init__()
        self.grad_placements = grad_placements

    def forward(self, *weights: DTensor) -> tuple[torch.Tensor, ...]:
        return tuple(w.to_local(grad_placements=p)
                     for w, p in zip(weights, self.grad_placements, strict=True))


def shard_experts(experts: nn.Module, mesh: DeviceMesh,
                  placements: dict[str, list[Placement]]) -> None:
    """Turn the expert weights into DTensors; replicas over tp (etp = 1) see different
    tokens, so their gradients are declared partial and summed."""
    for w in WEIGHTS:
        full = getattr(experts, w)
        experts.register_parameter(w, nn.Parameter(
            distribute_tensor(full, mesh, placements[w], src_data_rank=None)))
    experts.weights = LocalExpertWeights(
        [[Partial() if isinstance(p, Replicate) else p for p in placements[w]] for w in WEIGHTS])


def moe_tp_plan(moe: MoE) -> dict:
    """MoE input all-gathered from sequence-sharded to replicated (router replicated), the
    output's partial sums reduce-scattered back; shared experts column/row-wise."""
    plan: dict = {"moe": PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Partial(),), desired_output_layouts=(Shard(1),), use_local_output=True)}
    if moe.shared_experts is not None:
        plan.update({"moe.shared_experts.w1": ColwiseParallel(),
                     "moe.shared_experts.w2": RowwiseParallel(output_layouts=Partial()),
                     "moe.shared_experts.w3": ColwiseParallel()})
    return plan


def _sum_router_grads(tp_mesh: DeviceMesh, module: nn.Module, args: tuple,
                      output: tuple) -> tuple:
    """Each tp rank's gradient of the chosen weights is partial (it saw hidden shards or a
    share of the tokens); summed, the replicated router gets the full gradient."""
    top_scores, expert_idx, scores = output
    return sum_grad_over(top_scores, tp_mesh), expert_idx, scores


def apply_moe_parallel(model: nn.Module, dims: ParallelDims) -> None:
    """EP/ETP and the MoE TP plan on every MoE block (after the dense TP plan)."""
    names, placements = expert_placements(dims)
    if not names:
        return
    tp_mesh = dims.get_mesh("tp") if dims.tp_enabled else None
    ep_group = dims.get_mesh("ep").get_group() if dims.ep_enabled else None
    moe_blocks = [b for b in model.modules() if isinstance(getattr(b, "moe", None), MoE)]
    if not moe_blocks:  # a dense model: nothing to place, nothing to say
        return
    for block in moe_blocks:
        if tp_mesh is not None:
            parallelize_module(block, tp_mesh, moe_tp_plan(block.moe))
            block.moe.router.register_forward_hook(partial(_sum_router_grads, tp_mesh))
        shard_experts(block.moe.experts, dims.get_mesh(names), placements)
        dispatcher = TokenDispatcher(ep_group, tp_mesh, split_tokens=not dims.etp_enabled)
        block.moe.experts.register_forward_pre_hook(dispatcher.before)
        block.moe.experts.register_forward_hook(dispatcher.after)
    logger.info("MoE: experts on mesh %s (ep=%d, etp=%d, efsdp=%d)%s", names, dims.ep,
                dims.etp, dims.efsdp if dims.ep_enabled else dims.dp_shard * dims.cp,
                ", tp ranks split the tokens" if tp_mesh is not None and dims.etp == 1 else "")
