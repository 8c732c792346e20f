"""What each parallelism acts on in one model, so the recipe never looks inside a model.

A plan names the block container (AC wraps its entries, compile and FSDP2 take one unit per
block), each block's attention child, the FSDP2 units around the blocks, the routed experts
(kept eager under compile, their own dp mesh under EP) and the model's TP plan. A new model
kind (or a pipeline stage, whose blocks are a subset) is a new `ModelPlan`, not a new recipe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from loom.mesh import ParallelDims
from loom.models.hf import HFCausalLM
from loom.models.llama import Transformer
from loom.parallel.expert import apply_moe_parallel, moe_layers
from loom.parallel.hf import apply_hf_ac, decoder_blocks
from loom.parallel.tensor import apply_tp

TensorParallel = Callable[[ParallelDims, bool], None]
"""Applies TP (and EP) given the dims and whether the logits stay vocab-sharded."""


@dataclass
class ModelPlan:
    model: nn.Module
    layers: nn.ModuleDict | nn.ModuleList
    """The blocks; activation checkpointing replaces its entries with wrapped ones."""
    name: str = ""
    """What the log calls the model."""
    attention: str | None = "attention"
    """Each block's attention child: what `--ac selective` recomputes (None: no such child)."""
    before: list[nn.Module] = field(default_factory=list)
    after: list[list[nn.Module]] = field(default_factory=list)
    """FSDP2 units before and after the blocks (a list: modules sharded as one unit)."""
    lookups: list[nn.Module] = field(default_factory=list)
    """Units whose backward needs no weight (embedding tables): not gathered for backward."""
    experts: list[nn.Module] = field(default_factory=list)
    """Routed experts: data-dependent, so left eager by compile; own dp mesh under EP."""
    tensor_parallel: TensorParallel | None = None
    """The model's TP plan; None: the model runs at tp 1."""
    own_ac: Callable[[], None] | None = None
    """The model's own activation checkpointing, used instead of wrapping blocks."""
    fullgraph: bool = True
    """Compile blocks fullgraph (a graph break is an error) or let code loom does not own break."""

    def blocks(self) -> list[nn.Module]:
        """The container's current entries (wrapped ones once AC has run)."""
        if isinstance(self.layers, nn.ModuleDict):
            return list(self.layers.values())
        return list(self.layers)

    def fsdp_units(self) -> list[nn.Module | list[nn.Module]]:
        """FSDP2 units in forward order; the root comes last, added by the wrapper."""
        return [*self.before, *self.blocks(), *self.after]


def loom_plan(model: Transformer) -> ModelPlan:
    """loom's dense or MoE Transformer: embedding, blocks, [norm + output] as units (a
    pipeline stage holds the embedding only if first, norm and output only if last)."""

    def tensor_parallel(dims: ParallelDims, loss_parallel: bool) -> None:
        if dims.tp_enabled:
            apply_tp(model, dims.get_mesh("tp"), loss_parallel=loss_parallel)
        apply_moe_parallel(model, dims)

    before = [] if model.tok_embeddings is None else [model.tok_embeddings]
    after = [] if model.norm is None else [[model.norm, model.output]]
    return ModelPlan(model, model.layers, type(model).__name__, before=before, after=after,
                     lookups=before, experts=[moe.experts for moe in moe_layers(model)],
                     tensor_parallel=tensor_parallel)


def hf_plan(model: HFCausalLM) -> ModelPlan:
    """A Hugging Face model: its decoder blocks, its own checkpointing, no TP, and blocks
    compiled without fullgraph (a graph break in code loom does not own costs speed, not
    the run)."""
    return ModelPlan(model, decoder_blocks(model), f"Hugging Face {type(model.hf).__name__}",
                     attention=None,
                     own_ac=lambda: apply_hf_ac(model), fullgraph=False)


def model_plan(model: nn.Module) -> ModelPlan:
    if isinstance(model, HFCausalLM):
        return hf_plan(model)
    if isinstance(model, Transformer):
        return loom_plan(model)
    raise TypeError(f"no parallelize plan for {type(model).__name__}")
