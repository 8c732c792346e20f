"""FSDP2 units over the dp_shard mesh (or the 2-D HSDP mesh), precision and gradient division."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from loom.precision import torch_dtype

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def mixed_precision(dtype: str, reduce_dtype: str) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 (or bf16) gradient reduction; nothing cast under fp32."""
    if torch_dtype(dtype) == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                reduce_dtype=REDUCE_DTYPES[reduce_dtype])


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, reshard_after_forward: bool,
               mp_policy: MixedPrecisionPolicy) -> list[FSDPModule]:
    """One unit each: embedding, every block, [norm + output], then the root (a pipeline
    stage lacks the embedding or the head but for its first or last stage)."""
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    units = [] if model.tok_embeddings is None else [fully_shard(model.tok_embeddings, **kwargs)]
    units += [fully_shard(block, **kwargs) for block in model.layers.values()]
    if model.norm is not None:
        fully_shard([model.norm, model.output], **kwargs)
        units.append(model.norm)
    units.append(fully_shard(model, **kwargs))
    return units


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
