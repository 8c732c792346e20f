"""SimpleFSDP: data parallelism written as DTensor redistributions the compiler can see.

Every parameter is stored sharded (or replicated) over the data-parallel mesh. Reading it
(`module.weight`) in forward redistributes it to replicated: an all-gather, and in backward
the gradient declared partial is reduce-scattered (fully_shard), all-reduced (replicate) or
both (hybrid_shard). Mixed precision rides on the redistribution (cast before the gather,
reduce in the reduce dtype). Parameters already placed by TP or EP keep those placements:
the dp dims are prepended, and after the gather the tensor is re-wrapped on its own mesh.
Under torch.compile the whole model is one graph; the gathers are marked for recompute in
backward (reshard after forward) and inductor may bucket them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch._inductor.config as inductor_config
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
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from loom.config import ParallelConfig
from loom.mesh import ParallelDims
from loom.parallel.compile import compile_kwargs, prepare_compile
from loom.parallel.expert import apply_moe_compile, moe_layers
from loom.parallel.fsdp import REDUCE_DTYPES
from loom.precision import describe, torch_dtype

logger = logging.getLogger("loom")

_gathers_enabled = True


@contextmanager
def gathers_disabled() -> Iterator[None]:
    """Attribute reads return the stored (sharded) parameters, e.g. while initialising."""
    global _gathers_enabled
    previous, _gathers_enabled = _gathers_enabled, False
    try:
        yield
    finally:
        _gathers_enabled = previous


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by `factor` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def _recompute_everything(ctx: object, op: object, *args: object, **kwargs: object):
    return CheckpointPolicy.MUST_RECOMPUTE


@dataclass(frozen=True)
class Gather:
    """How one stored parameter becomes the tensor forward computes with.

    `inner_mesh`/`inner_placements` are the TP/EP placements it had before (None for a
    plain parameter); `inner_shape` is its shape on that mesh's local rank, i.e. the global
    shape over the dp mesh. The gradient is summed over dp and multiplied by `grad_scale`
    (1 / the full dp size, also for experts reduced over a smaller mesh).
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

    def __call__(self, param: DTensor) -> torch.Tensor:
        if self.recompute:  # under compile: re-gathered in backward instead of saved
            return checkpoint(self.gather, param, use_reentrant=False,
                              context_fn=partial(create_selective_checkpoint_contexts,
                                                 _recompute_everything))
        return self.gather(param)

    def gather(self, param: DTensor) -> torch.Tensor:
        x = _ScaleGrad.apply(param, self.grad_scale)
        if self.inner_mesh is not None:  # view the local TP/EP shard as a dp-only DTensor
            x = DTensor.from_local(x.to_local(), self.dp_mesh, self.dp_placements,
                                   shape=self.inner_shape, stride=_contiguous(self.inner_shape))
        n = self.dp_mesh.ndim
        local = x.redistribute(self.dp_mesh, [Replicate()] * n, forward_dtype=self.param_dtype,
                               backward_dtype=self.reduce_dtype,
                               ).to_local(grad_placements=[Partial()] * n)
        if self.inner_mesh is None:
            return local
        return DTensor.from_local(local, self.inner_mesh, self.inner_placements,
                                  shape=self.shape, stride=_contiguous(self.shape))


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


class SimpleFSDPModule:
    """Mixed into the root: gradients are reduced in every backward, so skipping the sync
    between accumulated micro-batches is not offered (reduction is linear: still exact)."""

    def set_requires_gradient_sync(self, requires_sync: bool) -> None:
        del requires_sync


def _gathered(name: str) -> property:
    def read(module: nn.Module) -> torch.Tensor:
        param = module._parameters[name]
        return module._simple_fsdp_gathers[name](param) if _gathers_enabled else param
    return property(read)


_CLASSES: dict[tuple[type, tuple[str, ...], bool], type] = {}


def _swap_class(module: nn.Module, names: tuple[str, ...], root: bool) -> None:
    """A subclass per (class, parameter names) whose parameter attributes gather on read."""
    cls = type(module)
    key = (cls, names, root)
    if key not in _CLASSES:
        bases = (SimpleFSDPModule, cls) if root else (cls,)
        _CLASSES[key] = type(f"SimpleFSDP{cls.__name__}", bases,
                             {n: _gathered(n) for n in names})
    module.__class__ = _CLASSES[key]


def dp_placements(dp_dims: tuple[str, ...]) -> tuple[Placement, ...]:
    """Replicated over dp_replicate, sharded on dim 0 over the (last) shard dim."""
    return tuple(Replicate() if d == "dp_replicate" else Shard(0) for d in dp_dims)


def _stored_placements(dp: tuple[Placement, ...], inner_mesh: DeviceMesh | None,
                       inner: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """dp placements prepended to the inner ones; where both shard dim 0 the dp shard is
    strided (it splits each inner shard, not the whole tensor)."""
    if inner_mesh is None:
        return dp
    split = math.prod(inner_mesh.size(i) for i, p in enumerate(inner)
                      if isinstance(p, Shard) and p.dim == 0)
    if split == 1:
        return (*dp, *inner)
    return (*(_StridedShard(0, split_factor=split) if isinstance(p, Shard) else p
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

    def shard(self, param: nn.Parameter) -> tuple[nn.Parameter, Gather]:
        """The stored parameter (on the meta device still) and its gather."""
        dp_mesh, dp = self.dims.get_mesh(self.dp_dims), dp_placements(self.dp_dims)
        inner_mesh = param.device_mesh if isinstance(param, DTensor) else None
        inner = tuple(param.placements) if inner_mesh is not None else ()
        mesh = dp_mesh if inner_mesh is None else self.dims.get_mesh(
            self.dp_dims + tuple(inner_mesh.mesh_dim_names))
        placements = _stored_placements(dp, inner_mesh, inner)
        full = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        stored = distribute_tensor(full, mesh, placements, src_data_rank=None)
        inner_shape = param.to_local().shape if inner_mesh is not None else param.shape
        gather = Gather(dp_mesh, dp, inner_mesh, inner, inner_shape, param.shape,
                        self.param_dtype, self.reduce_dtype, self.grad_scale, self.recompute)
        return nn.Parameter(stored, requires_grad=param.requires_grad), gather

    def wrap(self, module: nn.Module, root: bool = False) -> int:
        """Shard `module`'s direct parameters, unless it was wrapped already; returns how many."""
        if hasattr(module, "_simple_fsdp_gathers"):
            return 0
        params = dict(module.named_parameters(recurse=False))
        gathers = {}
        for name, param in params.items():
            stored, gathers[name] = self.shard(param)
            module.register_parameter(name, stored)
        if params or root:
            module._simple_fsdp_gathers = gathers
            _swap_class(module, tuple(params), root)
        return len(params)


def dense_dp_dims(dims: ParallelDims) -> tuple[str, ...]:
    """replicate (DDP), fully_shard (a size-1 shard mesh when dp is off, so mixed precision
    still applies) or hybrid_shard."""
    if dims.dp_replicate_enabled:
        return ("dp_replicate", "dp_shard") if dims.dp_shard_enabled else ("dp_replicate",)
    return ("dp_shard",)


def mode_name(dp_dims: tuple[str, ...]) -> str:
    if len(dp_dims) == 2:
        return "hybrid_shard"
    return "replicate" if dp_dims == ("dp_replicate",) else "fully_shard"


def data_parallel(dims: ParallelDims, cfg: ParallelConfig, dp_dims: tuple[str, ...]
                  ) -> DataParallel:
    mixed = torch_dtype(cfg.dtype) != torch.float32
    return DataParallel(dims, dp_dims, param_dtype=torch.bfloat16 if mixed else None,
                        reduce_dtype=REDUCE_DTYPES[cfg.reduce_dtype] if mixed else None,
                        grad_scale=1.0 / dims.dp_size,
                        recompute=recompute_gathers(cfg))


def recompute_gathers(cfg: ParallelConfig) -> bool:
    """Under compile, mark gathers for recompute in backward; not inside --ac regions: those
    recompute them already, and nested regions fail in AOTAutograd."""
    return (cfg.compile and cfg.reshard_after_forward == "always"
            and cfg.activation_checkpoint == "none")


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """Routed experts under expert parallel: they get their own, smaller dp mesh."""
    return [moe.experts for moe in moe_layers(model)]


def apply_simple_fsdp(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig) -> nn.Module:
    """Shard every parameter (experts first, over dp_shard_mod_ep), then compile: the whole
    model as one graph, or, with MoE layers, everything but the data-dependent experts."""
    experts = expert_modules(model)
    if dims.ep_enabled:
        expert_dims = (("dp_replicate",) if dims.dp_replicate_enabled else ()) + (
            "dp_shard_mod_ep",)
        expert_dp = data_parallel(dims, cfg, expert_dims)
        for module in experts:
            for child in module.modules():
                expert_dp.wrap(child)
    dp_dims = dense_dp_dims(dims)
    dense = data_parallel(dims, cfg, dp_dims)
    count = sum(dense.wrap(m) for m in model.modules() if m is not model)
    count += dense.wrap(model, root=True)
    logger.info("SimpleFSDP: %s over %s, %d parameter tensors, %s", mode_name(dp_dims),
                dp_dims, count, describe(cfg.dtype, cfg.reduce_dtype))
    if cfg.compile:
        maybe_compile(model, cfg, moe=bool(experts))
    return model


def maybe_compile(model: nn.Module, cfg: ParallelConfig, moe: bool) -> None:
    """Whole-model fullgraph compile (gathers recomputed in backward, bucketed by inductor);
    MoE models keep the per-piece compile that leaves the routed experts eager."""
    if moe:
        apply_moe_compile(model, cfg.compile_mode, cfg.act_mem_budget, cfg.compile_backend)
        return
    prepare_compile(model, cfg.act_mem_budget)
    if cfg.compile_backend == "inductor" and torch.cuda.is_available():
        inductor_config.bucket_all_gathers_fx = "only_fsdp"
        inductor_config.bucket_reduce_scatters_fx = "all"
    model.compile(**compile_kwargs(cfg.compile_mode, cfg.compile_backend))
    logger.info("SimpleFSDP: compiled the whole model (%s, fullgraph, gathers %s)",
                cfg.compile_backend, "recomputed in backward"
                if cfg.reshard_after_forward == "always" else "kept for backward")
