"""The tensor-parallel styles a plan shards its linears with: torch's, or torchao's float8
ones for the linears the float8 converter swapped for tensorwise `Float8Linear`s.

torchao's `Float8ColwiseParallel` / `Float8RowwiseParallel` / `PrepareFloat8ModuleInput`
shard the parameters as torch's styles do; they also cast each linear's input to float8
*before* the sequence-parallel all-gather (half the bytes, one cast shared by wq/wk/wv or
w1/w3), with the scale taken from the whole (DTensor) activation, and mark the output's
gradient for a float8 cast. They support tensorwise scaling only and refuse a plain linear:
rowwise `Float8Linear`s and the linears the converter left alone keep torch's styles, which
shard an `nn.Linear` subclass alike.

Over gloo they are not used: gloo (torch 2.13) carries no float8 dtype, and torchao's
float8 all-gather fails in `wait_tensor` with "RuntimeError: Invalid scalar type". torch's
styles hand the `Float8Linear` DTensor inputs, so its casts take the same whole-tensor
scales; only the all-gathers move --dtype bytes (CPU runs are for numerics, not speed).

The choice is made per module, read off the model, not the config, so a family plan stays
family-agnostic about float8: it names its modules and asks `Styles` for each one's style.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

TORCHAO_LINEAR = "torchao.float8.float8_linear"
TORCHAO_TP = "torchao.float8.float8_tensor_parallel"
NO_FLOAT8_BACKENDS = frozenset({"gloo"})
"""Process-group backends whose collectives reject float8 tensors."""


def tensorwise_float8(module: nn.Module) -> bool:
    """Whether `module` is a torchao `Float8Linear` with tensorwise scales. torchao is an
    optional dependency the float8 converter imports: if it is not loaded, nothing is."""
    linear = sys.modules.get(TORCHAO_LINEAR)
    if linear is None or not isinstance(module, linear.Float8Linear):
        return False
    tensorwise = sys.modules["torchao.float8.config"].ScalingGranularity.TENSORWISE
    config = module.config
    return all(cast.scaling_granularity is tensorwise for cast in (
        config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output))


def carries_float8(mesh: DeviceMesh) -> bool:
    """Whether the mesh's collectives take float8 tensors (not gloo's)."""
    return dist.get_backend(mesh.get_group()) not in NO_FLOAT8_BACKENDS


class Styles:
    """The styles for one module tree (a block): `colwise` / `rowwise` by the linear's fqn,
    `prepare_input` for a module whose linears all read its input (float8 only if every
    linear under it is tensorwise float8: a plain linear cannot take a float8 input)."""

    def __init__(self, root: nn.Module, float8_comm: bool):
        self.root = root
        self.float8_comm = float8_comm

    def _float8(self, fqn: str) -> bool:
        return self.float8_comm and tensorwise_float8(self.root.get_submodule(fqn))

    def _torchao(self) -> Any:
        return importlib.import_module(TORCHAO_TP)  # loaded with the float8 linears

    def colwise(self, fqn: str, **kwargs: Any) -> ParallelStyle:
        if self._float8(fqn):
            return self._torchao().Float8ColwiseParallel(**kwargs)
        return ColwiseParallel(**kwargs)

    def rowwise(self, fqn: str, **kwargs: Any) -> ParallelStyle:
        if self._float8(fqn):
            return self._torchao().Float8RowwiseParallel(**kwargs)
        return RowwiseParallel(**kwargs)

    def prepare_input(self, fqn: str, **kwargs: Any) -> ParallelStyle:
        linears = [m for m in self.root.get_submodule(fqn).modules()
                   if isinstance(m, nn.Linear)]
        if self.float8_comm and linears and all(tensorwise_float8(m) for m in linears):
            return self._torchao().PrepareFloat8ModuleInput(**kwargs)
        return PrepareModuleInput(**kwargs)
