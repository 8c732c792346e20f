"""What the rest of loom knows of a model family: one `ModelSpec`, read, never reached around.

A family lives in one folder, `loom/models/<family>/`, with the plain-PyTorch model, its
arguments dataclass (what a checkpoint records and is checked against), how the config
fills it, and a spec. Everything outside the folder (the parallelize recipe, pipeline cuts,
context parallel, compile, init, FLOP counting, float8, histograms, Hugging Face import and
export) asks the spec, so a new family touches no module outside its folder. A built model
carries its family's name (`FAMILY_ATTR`), so the spec is found by name, never by class.
A family registers once, as one record: this spec, which holds its flags and Hugging Face
adapters and is given its parallel plan at registration (models never import the parallel
code; loom's own families register in `loom/families.py`, one line each).

The model protocol a spec promises (written down because the recipe relies on it):
- `forward(tokens, ctx=None)`: ids (B, T) -> logits (B, T, V); `tokens` may be the previous
  pipeline stage's hidden states when the embedding is None. `ctx` is one declared record,
  `loom.models.context.ForwardContext`, of what a layout or the loss hands this forward:
  a cp shard's positions and mask, the documents of --doc-mask, the whole sequences' ids,
  whether to return hidden states (`hidden`) or a loss the head computes on its weight
  (`head_apply`, fused-linear inside the head's FSDP2 unit), and whether to return the
  family's extra prediction depths below the main rows (`depths`, see `Depths`). Models
  never read an attribute the trainer set on them; layouts change `ctx`, not the model.
- A pipeline stage is the model with its embedding, or its head modules, set to None and
  blocks deleted from the block container (a `ModuleDict` keyed by layer index, so the
  remaining parameters keep their names); `forward` skips what is None and returns hidden
  states when the head is gone.
- `init_std(name) -> float | None`: the initial std of a parameter by name (None: ones);
  `init_buffers(device)`: recompute non-persistent buffers after `to_empty`. Parameters are
  drawn from (seed, name), so every layout starts from the same weights.
- A loss the model adds inside its own forward (MoE's balance loss) is weighed by the
  family itself: the executor hands the spec's `weigh_own_losses` each part and the
  forwards of one optimizer step before the first step. Auxiliary predictions (MTP
  depths) are returned instead, and scored by the criterion against the labels with the
  main loss's modes and token weighting.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class ModelParts:
    """Attribute names of a family's parts, as the generic code reaches them: each family
    names its own (loom's in `models/llama/spec.py`'s `PARTS`), so nothing outside its folder
    spells them."""

    embedding: str | None
    """The token embedding (a lookup: no weight gradient needs it gathered for backward)."""
    blocks: str
    """The block container, a ModuleDict keyed by layer index."""
    head: tuple[str, ...]
    """The modules after the blocks, in order; a pipeline's last stage holds them together."""
    output: str | None
    """The output projection (logit histograms, fused-linear losses reach its weight)."""
    attention: str | None = None
    """Each block's attention child: what `--ac selective` recomputes."""
    attention_core: str | None = None
    """Within a block, the (q, k, v) -> out module that context parallel replaces."""
    feed_forward: tuple[str, ...] = ()
    """Each block's feed-forward child (dense or routed): what `--hist ffn` records."""


@dataclass
class ModelPlan:
    """What each parallelism acts on in one built model (or pipeline stage)."""

    model: nn.Module
    container: nn.ModuleDict | nn.ModuleList
    """The blocks' container; activation checkpointing replaces its entries with wrapped
    ones."""
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
    """Routed experts: data-dependent row counts (compiled with their block, see
    `loom.parallel.compile`); their own dp mesh under EP."""
    tensor_parallel: Callable[[Any, bool], None] | None = None
    """The model's TP (and EP) plan, given the ParallelDims and whether the logits stay
    vocab-sharded; None: the model runs at tp 1."""
    context_parallel: Callable[[Any], None] | None = None
    """The model's own context-parallel wiring besides the attention cores, given a sum
    over the cp ranks with gradient (MoE: its balance loss's per-sequence sums); None:
    nothing."""
    own_ac: Callable[[], None] | None = None
    """The model's own activation checkpointing, used instead of wrapping blocks."""
    fullgraph: bool = True
    """Compile blocks fullgraph (a graph break is an error) or let code loom does not own break."""
    spec: Any = None
    """The family's `ModelSpec`, set by `loom.parallel.model_plan.model_plan`: what
    `parallelize` asks (parts for context parallel, the embedding for compile) without
    looking the family up again."""

    def blocks(self) -> list[nn.Module]:
        """The container's current entries (wrapped ones once AC has run)."""
        if isinstance(self.container, nn.ModuleDict):
            return list(self.container.values())
        return list(self.container)

    def fsdp_units(self) -> list[nn.Module | list[nn.Module]]:
        """FSDP2 units in forward order; the root comes last, added by the wrapper."""
        return [*self.before, *self.blocks(), *self.after]


class HFAdapter(Protocol):
    """How a family's weights and shape map to and from one Hugging Face architecture.
    An adapter may also define `absent_modules(args, names)` (loom prefixes of modules a
    folder holding those tensor names lacks wholly, initialised instead of read) and
    `notes(args, names)` (lines logged about them); `loom.hf.checkpoint` asks for both."""

    architectures: tuple[str, ...]
    """The `architectures` entries of a config.json this adapter reads."""

    def fields_from_hf(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """loom's model config fields for a Hugging Face config.json; raises ValueError naming
        the setting loom cannot reproduce."""
        ...

    def sources(self, args: Any) -> dict[str, tuple[list[str], Callable]]:
        """loom parameter name -> (Hugging Face tensor names, function of those tensors that
        returns loom's tensor)."""
        ...

    def export_refusal(self, args: Any) -> str | None:
        """Why this model has no Hugging Face equivalent (one phrase), or None."""
        ...

    def settle(self, args: Any, read: Callable[[str], torch.Tensor]) -> Any:
        """The arguments to export with, given the trained tensors (a tie that training
        broke is written untied)."""
        ...

    def hf_config(self, args: Any, dtype: str) -> dict[str, Any]:
        """The config.json of the exported model."""
        ...

    def hf_tensors(self, args: Any, read: Callable[[str], torch.Tensor]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        """The exported tensors one at a time, reading loom's by name through `read`."""
        ...


FAMILY_ATTR = "loom_family"
"""The attribute `ModelSpec.new` sets on a built model: its family's name (a deep copy, a
pipeline stage, keeps it)."""


@dataclass(frozen=True)
class SpecHook:
    """A step hook the family registers itself (`loom.protocols.extensions` runs it after
    every optimizer step of a model of this family)."""

    name: str
    run: Callable[[nn.Module, Callable[[torch.Tensor], torch.Tensor], int, torch.Tensor],
                  dict[str, torch.Tensor]]
    """(the rank's model part, an in-place sum over the ranks holding different tokens,
    how many such ranks there are, whether the optimizer applied this step's update: a
    device scalar, 1.0 or 0.0) -> metrics for the step's row, on the device. The sum comes
    from the trainer so that models do no communication of their own; the hook runs after
    every step and masks its own update with `applied`, so that the trainer never reads
    whether a step was finite between logging steps."""
    stages: bool = False
    """Whether its metrics are of modules only some pipeline stages hold (DeepSeek-V3's MTP,
    with the head): the trainer's sum then also adds over the stages, so every rank's row
    (rank 0's holds the first stage) reports them. Such a hook returns the same metrics on
    every rank, zeros where its stage holds none of the modules."""
    token_sums: tuple[str, ...] = ()
    """The buffers (by name, in any module) whose per-rank values the hook sums over the
    ranks holding different tokens (MoE's `tokens_per_expert`): a layout that splits those
    ranks into parts the trainer's sum does not span (--ft-replica-groups) sums these
    across its parts before the hook runs, so that the hook's sum is the job's."""


def _none(model: nn.Module) -> list[nn.Module]:
    return []


@dataclass(frozen=True)
class Routing:
    """What the planner and `verify` need of a routed family's shape, asked of its spec
    rather than read from its flags."""

    experts: int
    """Routed experts per routed block."""
    top_k: int
    """Experts each token is routed to."""
    dense_layers: int
    """Leading blocks with a dense feed-forward instead."""


def _dense(args: Any) -> Routing | None:
    return None


@dataclass(frozen=True)
class Depths:
    """A family's extra prediction depths (DeepSeek-V3's MTP): asked with `ctx.depths`,
    the model returns, below the main rows, depth d's rows for d = 1 ... `count`, whose
    position i predicts the token d + 1 ahead (the label d ahead). The criterion scores
    them like the main rows and adds `weight` times their mean over depths."""

    count: int = 0
    weight: float = 0.0
    metric: str = ""
    """The metric the depths' loss is reported as (the step's loss is the main rows')."""


NO_DEPTHS = Depths()


def _no_depths(model: nn.Module) -> Depths:
    return NO_DEPTHS


@dataclass(frozen=True)
class ModelSpec:
    """One model family: how to build it and what every parallelism acts on."""

    name: str
    model_cls: type[nn.Module]
    """What the family builds (a model built without `new` is found by this class)."""
    args_from_config: Callable[[Any], Any]
    """ModelConfig -> the family's arguments (the flags and preset fill them)."""
    build: Callable[[Any], nn.Module]
    """Arguments -> the unparallelized model (built under whatever device is current)."""
    args_cls: type | None = None
    """The arguments dataclass: a checkpoint's `model_args` must hold exactly its fields,
    each of its type; None: the family records no arguments of its own."""
    parts: ModelParts | None = None
    """Attribute names of the parts; None: the model cannot be cut or context-parallel."""
    block_cost: Callable[[nn.Module], float] | None = None
    """A block's FLOP-bearing parameters per token (routed experts count by top-k / E);
    None: all of them."""
    hf: tuple[HFAdapter, ...] = ()
    """Hugging Face architectures served natively by this family."""
    lora_targets: tuple[str, ...] = ()
    """The linears within a block that `--lora-rank` adapts by default (module paths
    relative to the block; those no block of a model has are skipped, so a family whose
    shape decides a layer, as DeepSeek-V3's query bottleneck does, names each variant);
    empty: the user names them with --lora-targets."""
    description: str = ""
    block_inputs: Callable[[nn.Module], tuple[Any, ...]] = lambda model: ()
    """What a block's forward takes after the hidden states (Llama: the RoPE table)."""
    routers: Callable[[nn.Module], list[nn.Module]] = _none
    """The router gates (linears that stay in --dtype under float8)."""
    active_params: Callable[[Any], int] | None = None
    """Arguments -> the parameters one token multiplies (routed experts by top-k / E);
    None: all of them."""
    routing: Callable[[Any], Routing | None] = _dense
    """Arguments -> the routed experts' shape (None: a dense model)."""
    hooks: tuple[SpecHook, ...] = ()
    """Step hooks every run of this family uses (the MoE expert-bias update)."""
    plan: Callable[[nn.Module], ModelPlan] | None = None
    """The family's parallel plan (built model or stage -> `ModelPlan`). Models never import
    the parallel code, so it is given when the family registers
    (`loom.models.registry.register(spec, plan=...)`, in `loom/families.py` for
    loom's own); None: the family cannot be parallelized."""
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """The family's presets (`--model NAME`): name -> every flag the preset sets; added to
    `loom.config.presets` when the family registers."""
    aliases: Mapping[str, str] = field(default_factory=dict)
    """Other names users type for those presets -> the preset's name."""
    layouts: tuple[str, ...] = ()
    """Layouts run on this family's own modules beyond the shared composition matrix (a family
    with its own attention or heads names them), each matching one process in a parity test
    (the tests map each name to its test); listed in docs/parallelism.md."""
    refusals: tuple[str, ...] = ()
    """What the family refuses in one line (its flags' `check`), and why: listed in
    docs/parallelism.md."""
    depths: Callable[[nn.Module], Depths] = _no_depths
    """A built model or pipeline stage -> its extra prediction depths: what the criterion
    scores and a pipeline sends between stages (1 + count row blocks per micro-batch)."""
    flags: tuple[type, ...] = ()
    """The family's own flag dataclasses (`loom.config.families`: `flag()` fields, their
    defaults and a `check(cfg)`), registered with the family; its arguments are filled from
    them and the shared model flags."""
    flex_doc_mask: bool = False
    """The family's attention takes FlexAttention's block mask for --doc-mask, built where
    a forward's context asks (`ForwardContext.flex_mask`: compiled runs); the planner then
    counts no dense T x T mask for such a run."""
    weigh_own_losses: Callable[[nn.Module, int], None] | None = None
    """(a built part, the forwards of one optimizer step) -> None, for a family whose
    forward adds a loss of its own (MoE's balance loss): each forward's share weighs
    1 / forwards, as the main loss's token mean weighs each micro-batch's share of the
    step. None: the family adds no loss in its forward."""
    uses: frozenset[str] | None = None
    """The model flags (shared and families' own, by field name) that change what this
    family builds or trains; any other model flag a user gives is refused in one line
    (`loom.config.uses`). None: undeclared, nothing refused (a family that predates it)."""

    def part(self, model: nn.Module, name: str | None) -> nn.Module | None:
        return None if name is None else getattr(model, name, None)

    def new(self, args: Any) -> nn.Module:
        """The model of `args`, marked with this family's name."""
        model = self.build(args)
        setattr(model, FAMILY_ATTR, self.name)
        return model

    def field_names(self) -> tuple[str, ...]:
        return () if self.args_cls is None else tuple(f.name for f in fields(self.args_cls))

    def record(self, args: Any) -> dict[str, Any]:
        """The arguments as a checkpoint records them: every field of the dataclass."""
        return {name: getattr(args, name) for name in self.field_names()}

    def embedding(self, model: nn.Module) -> nn.Module | None:
        return None if self.parts is None else self.part(model, self.parts.embedding)

    def blocks(self, model: nn.Module) -> nn.ModuleDict | None:
        """The block container (None: the family names none, or the model lacks it)."""
        found = None if self.parts is None else self.part(model, self.parts.blocks)
        return found if isinstance(found, nn.ModuleDict) else None

    def output(self, model: nn.Module) -> nn.Module | None:
        """The output projection (None where a pipeline stage does not hold it)."""
        return None if self.parts is None else self.part(model, self.parts.output)
