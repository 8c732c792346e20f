"""SimpleFSDP: data parallelism written as DTensor redistributions the compiler can see.

Every parameter is stored sharded (or replicated) over the data-parallel mesh. Reading it
(`module.weight`, through a torch parametrization) in forward redistributes it to
replicated: an all-gather, and in backward the gradient declared partial is
reduce-scattered (fully_shard), all-reduced (replicate) or both (hybrid_shard). Mixed
precision rides on the redistribution (cast before the gather, reduce in the reduce dtype).
Parameters already placed by TP or EP keep those placements: the dp dims are prepended, and
after the gather the tensor is re-wrapped on its own mesh.
Under torch.compile the whole model is one graph; the gathers are marked for recompute in
backward (reshard after forward) and inductor may bucket them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.utils import parametrize
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from loom.config import ParallelConfig
from loom.models.spec import ModelPlan
from loom.numerics.precision import torch_dtype
from loom.parallel.fsdp import REDUCE_DTYPES, expert_placement
from loom.parallel.mesh import ParallelDims
from loom.runtime.scope import GlobalSettings


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by `factor` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class _AddGrad(torch.autograd.Function):
    """Identity in forward; adds `pending` to the gradient in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
        ctx.pending = pending
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad + ctx.pending, None


def _recompute_everything(ctx: object, op: object, *args: object, **kwargs: object):
    return CheckpointPolicy.MUST_RECOMPUTE


class GradSync:
    """Whether a parameter's gradient is reduced in this backward (FSDP2's contract).

    Between synced backwards the gathered parameter's gradient accumulates unreduced in
    `buffer` (a full-size leaf, like FSDP2's unsharded gradient); the synced backward adds
    it to its own before the one reduction. Reduction is linear, so the result is exact.
    """

    def __init__(self, dtype: torch.dtype | None):
        self.dtype = dtype
        self.sync = True
        self.buffer: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None

    def set(self, sync: bool, shape: torch.Size, device: torch.device) -> None:
        """Called before each forward, outside any compiled region."""
        self.sync, self.pending = sync, None
        if sync and self.buffer is not None:
            self.pending, self.buffer = self.buffer.grad, None
        elif not sync and self.buffer is None:
            self.buffer = torch.zeros(shape, dtype=self.dtype, device=device, requires_grad=True)

    def deferring(self) -> bool:
        return not self.sync and self.buffer is not None and torch.is_grad_enabled()

    def defer(self, local: torch.Tensor) -> torch.Tensor:
        """`local` whose gradient goes to the buffer instead of the reduction."""
        return local.detach() + (self.buffer - self.buffer.detach()).to(local.dtype)


@dataclass(frozen=True)
class Gather:
    """How one stored parameter becomes the tensor forward computes with.

    `inner_mesh`/`inner_placements` are the TP/EP placements it had before (None for a
    plain parameter); `inner_shape` is its shape on that mesh's local rank, i.e. the global
    shape over the dp mesh. The gradient is summed over dp and multiplied by `grad_scale`
    (1 / dp x cp, the ranks holding different tokens, also for experts reduced over a
    smaller mesh), in the backward
    `grad_sync` allows.
    """

    dp_mesh: DeviceMesh
    dp_placements: tuple[Placement, ...]
    inner_mesh: DeviceMesh | None
    inner_placements: tuple[Placement, ...]
    inner_shape: torch.Size
    shape: torch.Size
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    grad_scale: float
    recompute: bool
    grad_sync: GradSync

    def __call__(self, param: DTensor) -> torch.Tensor:
        if self.grad_sync.deferring():  # no reduction, so nothing to recompute either
            with torch.no_grad():
                local = self.replicate(param, self.param_dtype)
            return self.rewrap(self.grad_sync.defer(local))
        gather = partial(self.gather, pending=self.grad_sync.pending
                         if torch.is_grad_enabled() else None)
        if self.recompute:  # under compile: re-gathered in backward instead of saved
            return checkpoint(gather, param, use_reentrant=False,
                              context_fn=partial(create_selective_checkpoint_contexts,
                                                 _recompute_everything))
        return gather(param)

    def gather(self, param: DTensor, pending: torch.Tensor | None) -> torch.Tensor:
        """All-gathered in forward; in backward the gradient (plus the `pending` one, which
        needs the gather uncast so the sum is taken in its dtype) is reduced and scaled."""
        if pending is None:
            return self.rewrap(self.replicate(param, self.param_dtype))
        local = _AddGrad.apply(self.replicate(param, None), pending)
        return self.rewrap(local if self.param_dtype is None else local.to(self.param_dtype))

    def replicate(self, x: DTensor, dtype: torch.dtype | None) -> torch.Tensor:
        """The full (over dp) local tensor, cast to `dtype` before the all-gather; backward
        reduces its gradient, declared partial, in the reduce dtype, and scales it. The
        scale is taken on the dp-only view: torch 2.11's Dynamo fails a view of the stored
        (_StridedShard) DTensor (`PendingUnbackedSymbolNotFound`)."""
        if self.inner_mesh is not None:  # view the local TP/EP shard as a dp-only DTensor
            x = DTensor.from_local(x.to_local(), self.dp_mesh, self.dp_placements,
                                   shape=self.inner_shape, stride=_contiguous(self.inner_shape))
        x = _ScaleGrad.apply(x, self.grad_scale)
        n = self.dp_mesh.ndim
        return x.redistribute(self.dp_mesh, [Replicate()] * n, forward_dtype=dtype,
                              backward_dtype=self.reduce_dtype,
                              ).to_local(grad_placements=[Partial()] * n)

    def rewrap(self, local: torch.Tensor) -> torch.Tensor:
        if self.inner_mesh is None:
            return local
        return DTensor.from_local(local, self.inner_mesh, self.inner_placements,
                                  shape=self.shape, stride=_contiguous(self.shape))


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


class Gathered(nn.Module):
    """The parametrization a stored parameter is read through: its `Gather`."""

    def __init__(self, gather: Gather):
        super().__init__()
        self.gather = gather

    def forward(self, stored: DTensor) -> torch.Tensor:
        return self.gather(stored)


def gather_on_read(module: nn.Module, name: str, gather: Gather) -> None:
    """`module.<name>` becomes `gather(stored)`; the stored parameter moves to
    `module.parametrizations.<name>.original` (`clean_name` maps it back). Unsafe: the
    gather changes shape and type, and checking it would run a collective."""
    parametrize.register_parametrization(module, name, Gathered(gather), unsafe=True)


def set_gather_sync(model: nn.Module, sync: bool) -> None:
    """FSDP2's gradient-accumulation switch for every gathered parameter of `model`."""
    for module in model.modules():
        if isinstance(module, parametrize.ParametrizationList) and isinstance(
                module[0], Gathered):
            gather = module[0].gather
            gather.grad_sync.set(sync, gather.inner_shape, module.original.device)


def dp_placements(dp_dims: tuple[str, ...], shard_dim: int = 0) -> tuple[Placement, ...]:
    """Replicated over dp_replicate, sharded on `shard_dim` (0 unless that would pad a
    stacked expert weight, see `expert_placement`) over the (last) shard dim."""
    return tuple(Replicate() if d == "dp_replicate" else Shard(shard_dim) for d in dp_dims)


def _stored_placements(dp: tuple[Placement, ...], inner_mesh: DeviceMesh | None,
                       inner: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """dp placements prepended to the inner ones; where both shard the same dim the dp shard
    is strided (it splits each inner shard, not the whole tensor)."""
    if inner_mesh is None:
        return dp
    dim = next((p.dim for p in dp if isinstance(p, Shard)), None)
    split = math.prod(inner_mesh.size(i) for i, p in enumerate(inner)
                      if isinstance(p, Shard) and p.dim == dim)
    if split == 1:
        return (*dp, *inner)
    return (*(_StridedShard(dim, split_factor=split) if isinstance(p, Shard) else p
              for p in dp), *inner)


@dataclass(frozen=True)
class DataParallel:
    """Where and how to shard: the dp dims of `dims`' mesh, dtypes, grad scale, recompute."""

    dims: ParallelDims
    dp_dims: tuple[str, ...]
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    grad_scale: float
    recompute: bool
    placement: Callable[[nn.Parameter], Shard | None] | None = None
    """Where a parameter is sharded off dim 0 (stacked expert weights that dim 0 would pad);
    None (or it answering None): dim 0."""

    def shard(self, param: nn.Parameter) -> tuple[nn.Parameter, Gather]:
        """The stored parameter (on the meta device still) and its gather."""
        off_dim0 = self.placement(param) if self.placement is not None else None
        dp_mesh = self.dims.get_mesh(self.dp_dims)
        dp = dp_placements(self.dp_dims, off_dim0.dim if off_dim0 is not None else 0)
        inner_mesh = param.device_mesh if isinstance(param, DTensor) else None
        inner = tuple(param.placements) if inner_mesh is not None else ()
        mesh = dp_mesh if inner_mesh is None else self.dims.get_mesh(
            self.dp_dims + tuple(inner_mesh.mesh_dim_names))
        placements = _stored_placements(dp, inner_mesh, inner)
        full = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        stored = distribute_tensor(full, mesh, placements, src_data_rank=None)
        inner_shape = param.to_local().shape if inner_mesh is not None else param.shape
        gather = Gather(dp_mesh, dp, inner_mesh, inner, inner_shape, param.shape,
                        self.param_dtype, self.reduce_dtype, self.grad_scale, self.recompute,
                        GradSync(self.reduce_dtype or param.dtype))
        return nn.Parameter(stored, requires_grad=param.requires_grad), gather

    def wrap(self, module: nn.Module) -> int:
        """Shard `module`'s direct parameters, unless it was wrapped already (or holds the
        stored ones of a wrapped module); returns how many."""
        if parametrize.is_parametrized(module) or isinstance(
                module, parametrize.ParametrizationList):
            return 0
        params = dict(module.named_parameters(recurse=False))
        for name, param in params.items():
            stored, gather = self.shard(param)
            module.register_parameter(name, stored)
            gather_on_read(module, name, gather)
        return len(params)


def dense_dp_dims(dims: ParallelDims) -> tuple[str, ...]:
    """replicate (DDP), fully_shard (a size-1 shard mesh when dp is off, so mixed precision
    still applies) or hybrid_shard. Under cp the shard dim is dp_shard x cp, as FSDP2's
    (`ParallelDims.fsdp_mesh`): cp ranks hold different tokens of the same samples, so
    their gradients are summed too."""
    shard = "dp_shard_cp" if dims.cp_enabled else "dp_shard"
    if dims.dp_replicate_enabled:
        sharded = dims.dp_shard_enabled or dims.cp_enabled
        return ("dp_replicate", shard) if sharded else ("dp_replicate",)
    return (shard,)


def mode_name(dp_dims: tuple[str, ...]) -> str:
    if len(dp_dims) == 2:
        return "hybrid_shard"
    return "replicate" if dp_dims == ("dp_replicate",) else "fully_shard"


def data_parallel(dims: ParallelDims, cfg: ParallelConfig, dp_dims: tuple[str, ...],
                  experts: list[nn.Module] | None = None) -> DataParallel:
    """How to shard over `dp_dims`; `experts`' stacked weights are placed off dim 0 where
    dim 0 would pad, as the FSDP2 path places them (`expert_placement`)."""
    mixed = torch_dtype(cfg.dtype) != torch.float32
    shard = [dims.get_mesh(d).size() for d in dp_dims if d != "dp_replicate"]
    placement = expert_placement(experts, shard[-1]) if experts and shard else None
    return DataParallel(dims, dp_dims, param_dtype=torch.bfloat16 if mixed else None,
                        reduce_dtype=REDUCE_DTYPES[cfg.reduce_dtype] if mixed else None,
                        grad_scale=1.0 / dims.loss_size,
                        recompute=recompute_gathers(cfg), placement=placement)


def recompute_gathers(cfg: ParallelConfig) -> bool:
    """Under compile, mark gathers for recompute in backward; not inside --ac regions: those
    recompute them already, and nested regions fail in AOTAutograd."""
    return (cfg.compile and cfg.reshard_after_forward == "always"
            and cfg.activation_checkpoint == "none")


def bucketing_settings(cfg: ParallelConfig, device_type: str) -> GlobalSettings:
    """Inductor's FX passes that merge SimpleFSDP's many small all-gathers and
    reduce-scatters into buckets, for a compiled SimpleFSDP run on CUDA (where collectives
    overlap compute); read when the graph compiles, so the run keeps them in force
    (`loom.runtime.scope.applied`)."""
    if not (cfg.compile and cfg.compile_backend == "inductor"
            and cfg.data_parallel == "simple-fsdp" and device_type == "cuda"):
        return GlobalSettings()
    return GlobalSettings(compiler={"torch._inductor.config.bucket_all_gathers_fx": "only_fsdp",
                                    "torch._inductor.config.bucket_reduce_scatters_fx": "all"})


def apply_simple_fsdp(plan: ModelPlan, dims: ParallelDims, cfg: ParallelConfig,
                      backend: str) -> str:
    """The SimpleFSDP strategy: shard every parameter (routed experts first, over efsdp
    under EP); returns what it did, for the recipe's log line. Stacked
    expert weights are sharded off dim 0 where their (local) experts would not split evenly
    over the shard ranks, so no rank holds padding or nothing."""
    del backend  # the collectives are DTensor's, on the mesh's own backend
    if dims.ep_enabled:
        expert_dims = (("dp_replicate",) if dims.dp_replicate_enabled else ()) + ("efsdp",)
        expert_dp = data_parallel(dims, cfg, expert_dims, plan.experts)
        for module in plan.experts:
            for child in list(module.modules()):
                expert_dp.wrap(child)
    dp_dims = dense_dp_dims(dims)
    dense = data_parallel(dims, cfg, dp_dims, None if dims.ep_enabled else plan.experts)
    count = sum(dense.wrap(m) for m in list(plan.model.modules()))
    return (f"SimpleFSDP {mode_name(dp_dims)} over {dp_dims}, {count} parameter tensors, "
            f"gathers {'recomputed in backward' if recompute_gathers(cfg) else 'kept'}")
