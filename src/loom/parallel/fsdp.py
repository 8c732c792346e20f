"""FSDP2 units over the dp_shard mesh (or the 2-D HSDP mesh), precision and gradient division."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)
from torch.distributed.tensor import DTensor, Shard

from loom.config import ParallelConfig
from loom.config.pipeline_layout import SPLIT_BACKWARD
from loom.models.spec import ModelPlan
from loom.numerics.precision import torch_dtype
from loom.parallel.gloo_comm import use_pairwise_collectives
from loom.parallel.mesh import ParallelDims
from loom.runtime import flight

logger = logging.getLogger("loom")

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def mixed_precision(dtype: str, reduce_dtype: str) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 (or bf16) gradient reduction; nothing cast under fp32.

    Forward inputs are not cast (as torchtitan sets it): the activations are bf16 already,
    since they come out of bf16 weights, and casting each unit's inputs would also turn the
    fp32 RoPE table every block is handed into a bf16 copy, once per block per step. A
    reduce dtype equal to the parameters' is left unset: FSDP then reduces the gradients as
    they are, with no cast."""
    if torch_dtype(dtype) == torch.float32:
        return MixedPrecisionPolicy(cast_forward_inputs=False)
    reduce = REDUCE_DTYPES[reduce_dtype]
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                reduce_dtype=None if reduce == torch.bfloat16 else reduce,
                                cast_forward_inputs=False)


def one_unit(cfg: ParallelConfig) -> bool:
    """Whether the model (a pipeline stage) is one FSDP2 unit, kept gathered from forward to
    backward, rather than one unit per block: under the split-backward schedules, whose
    deferred weight gradients torch gets wrong for nested units (tests/parity/
    test_upstream_zbv.py). Not resharding after forward matters as much: torch finds the
    weights to differentiate among the stage's registered parameters, and a resharded
    stage registers its shards, not the gathered tensors the graph used, so a micro-batch's
    weight gradients went missing (the last stage's all of them). The whole stage is
    gathered for the step, so its parameters' memory is not spread over the blocks."""
    return cfg.pp > 1 and cfg.pp_schedule in SPLIT_BACKWARD


def apply_fsdp(plan: ModelPlan, dims: ParallelDims, cfg: ParallelConfig, backend: str) -> str:
    """The FSDP2 strategy: routed experts first (under EP), then one unit per plan unit
    (none under `one_unit`), then the root; returns what it did, for the recipe's log line."""
    reshard = cfg.reshard_after_forward == "always" and not one_unit(cfg)
    kwargs = dict(reshard_after_forward=reshard,
                  mp_policy=mixed_precision(cfg.dtype, cfg.reduce_dtype))
    experts = shard_experts(plan.experts, dims, backend, **kwargs) if dims.ep_enabled else []
    units = []
    planned = [] if one_unit(cfg) else plan.fsdp_units()
    names = unit_names(plan.model, [*planned, *(plan.experts if dims.ep_enabled else [])])
    placement = expert_placement(plan.experts, dims.fsdp_mesh.shape[-1])
    for i, unit in enumerate(planned):
        # the last unit's backward starts right after its forward: resharding only re-gathers
        sharded = fully_shard(unit, mesh=dims.fsdp_mesh, mp_policy=kwargs["mp_policy"],
                              reshard_after_forward=reshard and i < len(planned) - 1,
                              shard_placement_fn=placement)
        if any(unit is lookup for lookup in plan.lookups):
            sharded.set_unshard_in_backward(False)
        units.append(unit[0] if isinstance(unit, list) else sharded)
    units.append(fully_shard(plan.model, mesh=dims.fsdp_mesh, **kwargs))
    hooked = [*planned, *(plan.experts if dims.ep_enabled else []), plan.model]
    outer = enclosing(plan.model, hooked)
    for unit in hooked:
        name_forward(unit, names[id(unit)], names.get(outer[id(unit)]))
    if cfg.grad_divide_factor:
        set_gradient_division(units, dims.loss_size, backend, shard_size=dims.dp_shard * dims.cp)
    by_name = [*plan.experts, *planned] if dims.ep_enabled else planned
    named = [(names[id(unit)], sharded) for unit, sharded in
             zip([*by_name, plan.model], [*experts, *units], strict=True)]
    if backend == "gloo" and cfg.gloo_collectives == "pairwise":
        use_pairwise_collectives(named)
    else:
        use_named_collectives(named)
    return (f"FSDP2 {len(units)} units over "
            f"{'HSDP' if dims.dp_replicate_enabled else 'dp_shard'} mesh "
            f"{tuple(dims.fsdp_mesh.shape)}, reshard after forward: "
            f"{'never (split backward)' if one_unit(cfg) else cfg.reshard_after_forward}")


def unit_names(model: nn.Module, units: list[nn.Module | list[nn.Module]]
                ) -> dict[int, str]:
    """id(unit) -> the name a hang report gives it: its qualified name in the model
    ('layers.3'; a unit of several modules joins theirs), and for the root, which holds the
    parameters no other unit does, the modules that own those ('norm, output')."""
    qualified = {id(m): name for name, m in model.named_modules()}
    names = {id(u): ", ".join(qualified.get(id(m), "?") for m in
                             (u if isinstance(u, list) else [u])) for u in units}
    taken = {id(p) for u in units for m in (u if isinstance(u, list) else [u])
             for p in m.parameters()}
    owners = dict.fromkeys(n.rpartition(".")[0] or n for n, p in model.named_parameters()
                           if id(p) not in taken)
    names[id(model)] = ", ".join(owners) or "root"
    return names


def enclosing(model: nn.Module, units: list[nn.Module | list[nn.Module]]
              ) -> dict[int, int | None]:
    """id(unit) -> id of the nearest unit around it (the root for a block, the block for
    its experts; None for the root), from the modules' qualified names."""
    qualified = {id(m): name for name, m in model.named_modules()}
    prefix = {id(u): qualified.get(id(u[0] if isinstance(u, list) else u), "")
              for u in units}
    outer: dict[int, int | None] = {}
    for u in units:
        around = [v for v in units if v is not u and v is not model and
                  prefix[id(u)].startswith(prefix[id(v)] + ".")]
        outer[id(u)] = None if u is model else \
            id(max(around, key=lambda v: len(prefix[id(v)]))) if around else id(model)
    return outer


def name_forward(unit: nn.Module | list[nn.Module], name: str, outer: str | None) -> None:
    """Hooks that tell `loom.runtime.flight` whose forward runs, so that a collective the Flight
    Recorder sees can be matched to the unit it gathers: the pre-hook goes before FSDP's
    own (prepend), which issues the all-gather; the post-hook gives the forward back to
    the `outer` unit (None after the root's). A timestamp and a tuple per call."""
    @torch.compiler.disable
    def begin(*_: Any) -> None:
        flight.in_unit(name)

    @torch.compiler.disable
    def end(*_: Any) -> None:
        flight.in_unit(outer)

    for module in unit if isinstance(unit, list) else [unit]:
        module.register_forward_pre_hook(begin, prepend=True)
        module.register_forward_hook(end, always_call=True)


class InUnit:
    """Mixed into one of FSDP's own collectives: each call runs inside
    `loom.runtime.flight.moving(unit)`, so the Flight Recorder's entry for it is matched to
    the unit whose parameters it moves, in forward, backward or a prefetch alike."""

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with flight.moving(self.unit):
            return super().__call__(*args, **kwargs)  # type: ignore[misc]


class NamedAllGather(InUnit, DefaultAllGather):
    """FSDP's own all-gather, named by its unit."""


class NamedReduceScatter(InUnit, DefaultReduceScatter):
    """FSDP's own reduce-scatter, named by its unit."""


def use_named_collectives(units: list[tuple[str, FSDPModule]]) -> None:
    """Give every FSDP2 unit torch's default collectives, named (`NamedAllGather`). A unit
    torch refuses custom collectives for (several parameter groups) keeps its own and is
    named by the forward hooks only."""
    for name, unit in units:
        try:
            unit.set_custom_all_gather(NamedAllGather(name))
            unit.set_custom_reduce_scatter(NamedReduceScatter(name))
        except ValueError:
            logger.debug("FSDP2 unit %s keeps its own collectives (several param groups)", name)


def shard_experts(experts: list[nn.Module], dims: ParallelDims, backend: str,
                  **kwargs: Any) -> list[FSDPModule]:
    """Under EP, routed experts are their own FSDP units over efsdp (even at size 1, so
    mixed precision applies). Their gradients are summed over other ranks than the dense
    ones (the all-to-all already brought every token's contribution to its expert's owner)
    but must still be divided by every rank holding different tokens (dp x cp), or EP
    changes the numbers."""
    placement = expert_placement(experts, dims.expert_fsdp_mesh.shape[-1])
    units = [fully_shard(e, mesh=dims.expert_fsdp_mesh, shard_placement_fn=placement, **kwargs)
             for e in experts]
    set_gradient_division(units, dims.loss_size, backend, shard_size=dims.efsdp)
    logger.info("FSDP2: %d expert units over mesh %s, gradients divided by dp x cp %d",
                len(units), tuple(dims.expert_fsdp_mesh.shape), dims.loss_size)
    return units


def expert_placement(experts: Iterable[nn.Module], shard_size: int
                     ) -> Callable[[nn.Parameter], Shard | None]:
    """FSDP2 shards on dim 0 and pads it to the shard count: stacked expert weights with
    fewer (local) experts than ranks would gather mostly padding (256 experts over 2048 ranks:
    8x their size). Where dim 0 does not split evenly, they are sharded on the first other
    dim that does (FSDP2 requires that off dim 0) and that tensor parallel leaves whole."""
    ids = {id(p) for e in experts for p in e.parameters()}

    def placement(param: nn.Parameter) -> Shard | None:
        if id(param) not in ids:
            return None
        local = param.to_local() if isinstance(param, DTensor) else param
        if not local.shape[0] % shard_size:
            return None
        taken = {p.dim for p in param.placements if isinstance(p, Shard)} \
            if isinstance(param, DTensor) else set()
        even = [d for d in range(1, local.dim()) if not local.shape[d] % shard_size
                and d not in taken]
        return Shard(even[0]) if even else None

    return placement


def set_gradient_division(units: list[FSDPModule], dp_size: int, backend: str, *,
                          shard_size: int) -> None:
    """Sum gradients in the collective and divide once by the dp size, instead of FSDP's
    pre/post split; backends without a fused pre-multiplied sum (all but NCCL) are told to
    reduce with a plain sum. Not on a size-1 shard mesh: there no reduce-scatter runs, and
    torch 2.13 would divide twice (in its size-1 copy and again after it)."""
    for unit in units:
        unit.set_gradient_divide_factor(float(dp_size))
        if backend != "nccl" and shard_size > 1:
            unit.set_force_sum_reduction_for_comms(True)
