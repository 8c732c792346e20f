"""The DeepSeek-V3 family's parallel plan: FSDP units, AC and compile targets as the dense
plan's; tensor parallel splits latent attention's heads; EP/ETP and the MoE TP plan are the
MoE family's.

Under tp the heads split: the up-projections (`wq`/`wq_b`, `wkv_b`) column-wise, `wo`
row-wise. The low-rank down-projections and their norms stay whole on every tp rank (they
are small): their inputs are the all-gathered hidden states, and the gradients reaching
them are already summed over tp by the column-wise projections' input, except the RoPE key
every head shares, which each rank uses only for its own heads: `shared_key`'s gradient is
summed over tp here.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from loom.models.context import context_of
from loom.models.llama.plan import dense_plan
from loom.models.moe.balance import moe_layers
from loom.models.moe.plan import apply_moe_parallel, complete_sequences
from loom.models.spec import ModelPlan
from loom.parallel.context import ContextParallelAttention, gather_sequence
from loom.parallel.expert import sum_grad_over
from loom.parallel.mesh import ParallelDims
from loom.parallel.tp_styles import Styles, carries_float8


def _summed_over(tp_mesh: DeviceMesh, module: nn.Module, args: tuple, output):
    return sum_grad_over(output, tp_mesh)


def block_tp_plan(block: nn.Module, styles: Styles) -> dict:
    colwise, rowwise, prepare = styles.colwise, styles.rowwise, styles.prepare_input
    up = ["attention.wq_b"] if hasattr(block.attention, "wq_b") else ["attention.wq"]
    plan = {"attention_norm": SequenceParallel(),
            "attention": prepare("attention", input_layouts=(Shard(1), None),
                                 desired_input_layouts=(Replicate(), None),
                                 use_local_output=True),
            **{name: colwise(name) for name in (*up, "attention.wkv_b")},
            "attention.wo": rowwise("attention.wo", output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel()}
    if hasattr(block, "feed_forward"):
        plan.update({
            "feed_forward": prepare("feed_forward", input_layouts=(Shard(1),),
                                    desired_input_layouts=(Replicate(),),
                                    use_local_output=True),
            "feed_forward.w1": colwise("feed_forward.w1"),
            "feed_forward.w2": rowwise("feed_forward.w2", output_layouts=Shard(1)),
            "feed_forward.w3": colwise("feed_forward.w3")})
    return plan


def mtp_under_cp(model: nn.Module, mesh: DeviceMesh) -> None:
    """The MTP blocks attend across cp like the main blocks (with a cp core as `apply_cp`
    put in those: it holds no parameters; a pipeline's last stage may hold no block to
    take it from), and each forward that runs the depths (`ctx.depths`) is handed the
    whole sequences' ids (`ctx.token_ids`), gathered over cp, from which the model picks
    every depth's shifted ids at this shard's positions. A pipeline stage gathers the ids
    the schedule hands every stage (this cp rank's shard): a stage past the first is
    given hidden states, not ids, as its input."""
    for module in model.mtp.values() if model.mtp is not None else ():
        module.block.attention.core = ContextParallelAttention(mesh)
    model.register_forward_pre_hook(partial(_gather_ids, mesh), with_kwargs=True)


def _gather_ids(mesh: DeviceMesh, module: nn.Module, args: tuple, kwargs: dict,
                ) -> tuple[tuple, dict]:
    ctx = context_of(args[1] if len(args) > 1 else kwargs.get("ctx"))
    if not ctx.depths:  # evaluation of a whole model runs no MTP
        return args, kwargs
    shard = ctx.token_ids if ctx.token_ids is not None else \
        (args[0] if args else kwargs["tokens"])
    return args[:1], {**kwargs, "ctx": ctx.with_(token_ids=gather_sequence(shard, mesh))}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Sequence-parallel norms and embedding, head-split attention, the dense blocks'
    SwiGLU split as Llama's; logits replicated or vocab-sharded (loss parallel)."""
    outer = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1),
                                  output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel)}
    parallelize_module(model, tp_mesh, {name: style for name, style in outer.items()
                                        if getattr(model, name) is not None})
    float8_comm = carries_float8(tp_mesh)
    mtp = list(model.mtp.values()) if getattr(model, "mtp", None) is not None else []
    for module in mtp:
        parallelize_module(module, tp_mesh, MTP_TP_PLAN)
    for block in [*model.layers.values(), *(module.block for module in mtp)]:
        parallelize_module(block, tp_mesh, block_tp_plan(block, Styles(block, float8_comm)))
        block.attention.shared_key.register_forward_hook(partial(_summed_over, tp_mesh))


MTP_TP_PLAN = {"enorm": SequenceParallel(), "hnorm": SequenceParallel(),
               "eh_proj": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(1)),
               "norm": SequenceParallel()}
"""An MTP module under tp: its inputs (the shifted tokens' embeddings, the previous depth's
hidden state) arrive sequence-sharded like a block's; the norms stay sequence-parallel and
the joint projection gathers the sequence, splits its output channels, and hands its
block the sequence-sharded layout the block's plan takes."""


def deepseek_v3_plan(model: nn.Module) -> ModelPlan:
    """The dense plan's units (MTP modules as units of their own), this TP plan, then the
    MoE family's EP/ETP; routed experts on their own dp mesh under EP."""
    plan = dense_plan(model)
    meshes: dict[str, DeviceMesh] = {}  # the cp mesh, for the MTP blocks' attention

    def tensor_parallel(dims: ParallelDims, loss_parallel: bool) -> None:
        if dims.cp_enabled:  # `parallelize` calls this first, always, then cp's wiring
            meshes["cp"] = dims.get_mesh("cp")
        if dims.tp_enabled:
            apply_tp(model, dims.get_mesh("tp"), loss_parallel)
        apply_moe_parallel(model, dims)

    def context_parallel(summed) -> None:
        if getattr(model, "mtp", None) is not None or model.args.mtp_layers:
            mtp_under_cp(model, meshes["cp"])
        complete_sequences(model, summed)

    mtp = getattr(model, "mtp", None)  # under pp, the last stage's (with the head)
    if mtp is not None:
        plan.after = [*mtp.values(), *plan.after]
    plan.tensor_parallel = tensor_parallel
    plan.context_parallel = context_parallel
    plan.experts = [moe.experts for moe in moe_layers(model)]
    return plan
