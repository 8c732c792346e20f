"""One process, one device: the model stays a plain module, with no data-parallel wrapper.

At world size 1 FSDP2 has nothing to shard, yet costs every step: each unit's unshard casts
and copies its parameters, each gradient is copied into a reduce buffer and divided by 1.0,
and its hooks split a compiled model into per-block graphs. Here the parameters are the
fp32 master weights the optimizer updates, bf16 compute comes from autocast around the
forward, and under --compile the whole model (embedding, blocks, norm, head) is one graph.
`--single-device fsdp2` ($LOOM_SINGLE_DEVICE) keeps FSDP2 at one process, for comparison.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from loom.config import ParallelConfig
from loom.models.spec import ModelPlan
from loom.numerics.precision import torch_dtype
from loom.parallel.mesh import ParallelDims


def runs_plain(dims: ParallelDims, cfg: ParallelConfig) -> bool:
    """Whether this rank's model stays unwrapped: one process, no pipeline, the default
    wrapper (SimpleFSDP, asked for by name, keeps its own path) and not told otherwise."""
    return (dims.world_size == 1 and cfg.data_parallel == "fsdp2"
            and cfg.single_device == "plain")


def autocast_forward(forward: Callable[..., Any], device_type: str,
                     dtype: torch.dtype) -> Callable[..., Any]:
    """`forward` under autocast: matmuls in `dtype`, the parameters (and so gradients and
    the optimizer's state) left in fp32. One context inside one function, so Dynamo
    traces it into the graph."""
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)
    return run


def apply_single_device(plan: ModelPlan, dims: ParallelDims, cfg: ParallelConfig,
                        backend: str) -> str:
    """Leave the model unwrapped; under bf16, run its forward under autocast (an instance
    attribute, so the class and the state-dict keys are untouched). Returns what it did."""
    dtype = torch_dtype(cfg.dtype)
    if dtype == torch.float32:
        return "single device, no wrapper"
    model: nn.Module = plan.model
    device_type = dims.get_mesh("dp").device_type  # the device the run got
    model.forward = autocast_forward(model.forward, device_type, dtype)  # type: ignore[method-assign]
    return "single device, no wrapper, bf16 autocast"
