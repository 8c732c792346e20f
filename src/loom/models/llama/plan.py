"""The Llama family's parallel plan: tensor + sequence parallel by module name, and the
FSDP units, AC and compile targets the generic recipe reads.

It lives with the parallel code, not in the family's folder, so that `loom.models` stays
free of `torch.distributed`; the family's spec points at it.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from loom.models.llama.model import Transformer, TransformerBlock
from loom.models.spec import ModelPlan
from loom.parallel.mesh import ParallelDims
from loom.parallel.tp_styles import Styles, carries_float8


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Shard matmuls across tp and keep activations between them sequence-sharded.

    The logits come out replicated, or vocab-sharded (a DTensor) for the loss-parallel mode.
    A MoE block's feed-forward gets its plan from parallel/expert.py. The blocks' linears
    take torchao's float8 styles when --float8 tensorwise swapped them (`tp_styles`); the
    embedding and the head stay in high precision, so they keep torch's.
    """
    outer = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel),
    }  # a pipeline stage holds only some of these
    parallelize_module(model, tp_mesh, {name: style for name, style in outer.items()
                                        if getattr(model, name) is not None})
    float8_comm = carries_float8(tp_mesh)
    for block in model.layers.values():
        styles = Styles(block, float8_comm)
        colwise, rowwise, prepare = styles.colwise, styles.rowwise, styles.prepare_input
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": prepare(
                "attention",
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                use_local_output=True),
            "attention.wq": colwise("attention.wq"),
            "attention.wk": colwise("attention.wk"),
            "attention.wv": colwise("attention.wv"),
            "attention.wo": rowwise("attention.wo", output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
        }
        if block.attention.q_norm is not None:  # per head: its input is sharded over heads
            per_head = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan.update({"attention.q_norm": per_head, "attention.k_norm": per_head})
        if isinstance(block, TransformerBlock) and block.ffn_name == "feed_forward":  # dense
            plan.update({
                "feed_forward": prepare(
                    "feed_forward",
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                    use_local_output=True),
                "feed_forward.w1": colwise("feed_forward.w1"),
                "feed_forward.w2": rowwise("feed_forward.w2", output_layouts=Shard(1)),
                "feed_forward.w3": colwise("feed_forward.w3"),
            })
        parallelize_module(block, tp_mesh, plan)


def dense_plan(model: Transformer) -> ModelPlan:
    """Embedding, blocks, [norm + output] as FSDP units (a pipeline stage holds the
    embedding only if first, norm and output only if last); the TP plan above."""

    def tensor_parallel(dims: ParallelDims, loss_parallel: bool) -> None:
        if dims.tp_enabled:
            apply_tp(model, dims.get_mesh("tp"), loss_parallel=loss_parallel)

    before = [] if model.tok_embeddings is None else [model.tok_embeddings]
    after = [] if model.norm is None else [[model.norm, model.output]]
    return ModelPlan(model, model.layers, type(model).__name__, before=before, after=after,
                     lookups=before, tensor_parallel=tensor_parallel)
