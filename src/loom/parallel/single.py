"""One process, one device: the model stays a plain module, with no data-parallel wrapper.

At world size 1 FSDP2 has nothing to shard, yet costs every step: each unit's unshard casts
and copies its parameters, each gradient is copied into a reduce buffer and divided by 1.0,
and its hooks split a compiled model into per-block graphs. Here the parameters are the
fp32 master weights the optimizer updates, bf16 compute comes from autocast around the
step's forward and loss, and under --compile the whole model (embedding, blocks, norm,
head) is one graph.
`--single-device fsdp2` ($LOOM_SINGLE_DEVICE) keeps FSDP2 at one process, for comparison.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from loom.config import ParallelConfig
from loom.models.spec import ModelPlan
from loom.numerics.precision import torch_dtype
from loom.parallel.mesh import ParallelDims


def runs_plain(dims: ParallelDims, cfg: ParallelConfig) -> bool:
    """Whether this rank's model stays unwrapped: one process, no pipeline, the default
    wrapper (SimpleFSDP, asked for by name, keeps its own path) and not told otherwise."""
    return (dims.world_size == 1 and cfg.data_parallel == "fsdp2"
            and cfg.single_device == "plain")


def step_autocast(dims: ParallelDims, cfg: ParallelConfig,
                  device_type: str) -> Callable[[], AbstractContextManager]:
    """The context a step runs its forward and loss in: on the plain path under bf16,
    autocast (matmuls in bf16, the parameters, and so gradients and the optimizer's state,
    left fp32); elsewhere nothing (FSDP2 and SimpleFSDP cast the weights themselves). The
    step enters it (`loom.trainer.executor`): the model itself is left as it is, its
    class, forward and state-dict keys untouched."""
    dtype = torch_dtype(cfg.dtype)
    if not runs_plain(dims, cfg) or dtype == torch.float32:
        return contextlib.nullcontext
    return functools.partial(torch.autocast, device_type, dtype=dtype)


def within(context: Callable[[], AbstractContextManager],
           fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run inside a fresh `context()`: one context inside one function, so Dynamo
    traces it into the graph where `fn` is compiled."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with context():
            return fn(*args, **kwargs)
    return run


def apply_single_device(plan: ModelPlan, dims: ParallelDims, cfg: ParallelConfig,
                        backend: str) -> str:
    """Leave the model unwrapped; bf16 comes from the step's autocast (`step_autocast`).
    Returns what it did."""
    if torch_dtype(cfg.dtype) == torch.float32:
        return "single device, no wrapper"
    return "single device, no wrapper, bf16 autocast around the step"
