"""What --compile does to a step's memory, for a trace that runs eager.

Dynamo cannot run under the trace's dispatch modes, so `loom.plan.trace` follows eager
code and this module supplies the two differences compile makes:

- A compiled block saves what inductor's min-cut partitioner picks at the activation
  memory budget, not what eager autograd saves. `compiled_block_fraction` asks the
  partitioner itself: one plain block's joint graph is traced under fake tensors with
  inductor's decompositions and partitioned as inductor does, and the forward graph's
  saved outputs are weighed against what the same block saves when it runs eager.
- The compiled cross-entropy fuses log-softmax, NLL and their backward: it keeps the
  logits and one fp32 value per row, and writes the gradient straight in the logits'
  dtype. `CompiledLossMemory` allocates exactly that and computes nothing. Compiled in
  one graph with the model (one process, `loss_in_graph`), the gradient overwrites the
  logits, a buffer the backward graph owns (`DonatedLossMemory`).

Both were checked against allocator-level measurements of real compiled CPU steps
(benchmarks/plan_accuracy.py); the donated loss also against three compiled steps on one
H200 (tests/unit/plan/test_device_runs.py).
"""

from __future__ import annotations

import functools

import torch
import torch._functorch.config as functorch_config
from torch import fx, nn
from torch._functorch.aot_autograd import aot_function
from torch._inductor.compile_fx import partition_fn as inductor_partition
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from loom.config import JobConfig, ModelConfig
from loom.config.pipeline_layout import choose_microbatches
from loom.models.registry import for_model, routing_of
from loom.models.resolve import plain_model
from loom.numerics.precision import default_dtype, torch_dtype

_VIEWS = {torch.ops.aten.t.default, torch.ops.aten.permute.default, torch.ops.aten.view.default,
          torch.ops.aten.alias.default, torch.ops.aten.transpose.int,
          torch.ops.aten._unsafe_view.default}


def compiled_block_fraction(cfg: JobConfig) -> float:
    """Saved activations of a compiled block over an eager one's (1.0 without --compile).

    Only blocks without activation checkpointing change: a checkpointed block saves its
    input either way. MoE blocks are left at 1.0 (their data-dependent routing is not traced
    here; an upper bound). Measured at the rank's micro-batch and sequence shard: the partitioner's
    choice under a budget depends on how activations weigh against the weights' views."""
    p = cfg.parallel
    if not p.compile or p.activation_checkpoint != "none" or routing_of(cfg.model):
        return 1.0
    batch = cfg.train.batch_size
    if p.pp > 1:
        batch //= choose_microbatches(p, batch)
    return _fraction(cfg.model, batch, cfg.data.seq_len // p.cp, p.dtype, p.act_mem_budget)


@functools.cache
def _fraction(model: ModelConfig, batch: int, seq_len: int, dtype: str, budget: float) -> float:
    with default_dtype(torch_dtype(dtype)), torch.device("meta"):
        whole = plain_model(JobConfig(model=model))
    spec = for_model(whole)
    block = next(iter(spec.blocks(whole).values()))
    with FakeTensorMode(allow_non_fake_inputs=True):
        block.to_empty(device="cpu")
        x = torch.empty(batch, seq_len, model.dim, dtype=torch_dtype(dtype), requires_grad=True)
        extra = tuple(torch.empty(t.shape, dtype=t.dtype) for t in spec.block_inputs(whole))
        return (_compiled_saved_bytes(block, (x, *extra), budget)
                / _eager_saved_bytes(block, (x, *extra)))


def _eager_saved_bytes(block: nn.Module, inputs: tuple[torch.Tensor, ...]) -> int:
    """Bytes an eager forward leaves alive: what autograd saved, and the output (which the
    next block saves as its input, as the compiled block saves `x`)."""
    tracker = MemTracker()
    tracker.track_external(block, *inputs)
    with tracker:
        (before,) = tracker.get_tracker_snapshot().values()
        out = block(*inputs)
        (after,) = tracker.get_tracker_snapshot().values()
    del out
    return after["Total"] - before["Total"]


def _compiled_saved_bytes(block: nn.Module, inputs: tuple[torch.Tensor, ...],
                          budget: float) -> int:
    """Bytes of the tensors the partitioner saves for backward (its forward graph's outputs
    after the block's own), parameters and their views excluded."""
    names, params = zip(*block.named_parameters(), strict=True)
    forward_graphs: list[fx.GraphModule] = []

    def keep_forward(gm: fx.GraphModule, _inputs: object) -> fx.GraphModule:
        forward_graphs.append(gm)
        return gm

    def call(*args: torch.Tensor) -> torch.Tensor:
        weights = dict(zip(names, args[:len(names)], strict=True))
        return torch.func.functional_call(block, weights, args[len(names):])

    with functorch_config.patch(activation_memory_budget=budget):
        aot_function(call, fw_compiler=keep_forward, bw_compiler=lambda gm, _: gm,
                     decompositions=select_decomp_table(),
                     partition_fn=inductor_partition)(*params, *inputs)
    (graph,) = forward_graphs
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    weights = set(placeholders[:len(params)])
    _, *saved = graph.graph.output_node().args[0]
    total = 0
    for node in saved:
        value = node.meta.get("val") if isinstance(node, fx.Node) else None
        if isinstance(value, torch.Tensor) and _root(node) not in weights:
            total += value.numel() * value.element_size()
    return total


def _root(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return node


class CompiledLossMemory(torch.autograd.Function):
    """The compiled cross-entropy's memory over (rows, vocab) logits, without its values:
    the forward saves the logits and an fp32 row statistic, the backward allocates one
    gradient in the logits' dtype. For traces under fake tensors only."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        row_stat = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(logits, row_stat)
        return logits.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, _ = ctx.saved_tensors
        return torch.empty_like(logits), None


class DonatedLossMemory(CompiledLossMemory):
    """The same loss compiled in one graph with the model that made the logits (--compile
    at one process): the logits are an intermediate the backward graph owns (AOTAutograd's
    donated buffers), so inductor writes their gradient into their own storage and the
    backward allocates nothing logits-sized. For traces under fake tensors only."""

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, _ = ctx.saved_tensors
        return logits, None


def compiled_loss_memory(logits: torch.Tensor, labels: torch.Tensor,
                         donated: bool = False) -> torch.Tensor:
    loss = DonatedLossMemory if donated else CompiledLossMemory
    return loss.apply(logits.flatten(0, -2), labels.flatten())
