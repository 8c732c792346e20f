"""Deterministic, mesh-independent weight initialisation of an already-parallelized model.

Each parameter's full value is drawn from its own generator, seeded by (seed, name), and
each rank keeps only its shard. The weights are therefore identical on any mesh and equal
to a single-process run, at the cost of one parameter-sized temporary at a time.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
_PARAMETRIZED = re.compile(r"parametrizations\.([^.]+)\.original$")
"""Where a parametrization (SimpleFSDP's gather) keeps the stored parameter."""


def clean_name(name: str) -> str:
    """Parameter name as in the plain model (and under FSDP2): without wrapper prefixes, and
    a parametrized parameter under its own name."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return _PARAMETRIZED.sub(r"\1", name)


def seeded_value(shape: torch.Size, std: float | None, seed: int, name: str) -> torch.Tensor:
    """The full initial value of parameter `name` (ones where `std` is None): the same on
    every rank and for every reader (a LoRA checkpoint's base is drawn again from it)."""
    if std is None:
        return torch.ones(shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**64)
    return torch.randn(shape, generator=gen) * std


Added = Callable[[str], float | None]
"""The initial std of a parameter a model converter added (None: the model's own)."""


def _no_added(name: str) -> float | None:
    return None


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, device: torch.device,
                 added: Added = _no_added) -> None:
    """Materialise a meta-built model on `device` and fill every parameter from the seed."""
    model.to_empty(device=device)
    for name, param in model.named_parameters():
        name = clean_name(name)
        std = added(name)
        full = seeded_value(param.shape, model.init_std(name) if std is None else std, seed,
                           name)
        _fill(param, full)
    model.init_buffers(device)


def _fill(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of the full value (drawn identically on every rank)."""
    if isinstance(param, DTensor):
        local = distribute_tensor(full, param.device_mesh, param.placements,
                                  src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def is_source(tensor: DTensor) -> bool:
    """Whether this rank holds coordinate 0 of the tensor's mesh: the rank that reads it."""
    coordinate = tensor.device_mesh.get_coordinate()
    return coordinate is not None and not any(coordinate)


@torch.no_grad()
def load_weights(model: nn.Module, device: torch.device,
                 read: Callable[[str], torch.Tensor], seed: int = 0,
                 added: Added = _no_added, fresh: tuple[str, ...] = ()) -> None:
    """Materialise a meta-built, parallelized model on `device` and fill every parameter
    with `read(name)`, the full tensor, which only the first rank of each parameter's mesh
    calls; `distribute_tensor` scatters the shards from it. Host memory per reader: its
    shards plus one full tensor at a time. Parameters a converter added (`added`) are in
    no source: drawn from `seed` as `init_weights` draws them, as are the modules under
    the prefixes `fresh` (ones a source may lack wholly: DeepSeek-V3's MTP modules)."""
    model.to_empty(device=device)
    for name, param in model.named_parameters():
        name = clean_name(name)
        std = added(name)
        if std is not None or name.startswith(fresh):
            _fill(param, seeded_value(param.shape, model.init_std(name) if std is None
                                      else std, seed, name))
            continue
        if not isinstance(param, DTensor):
            param.copy_(read(name))
            continue
        full = (read(name) if is_source(param)
                else torch.empty(param.shape, dtype=param.dtype)).to(device, param.dtype)
        local = distribute_tensor(full, param.device_mesh, param.placements,
                                  src_data_rank=0).to_local()
        param.to_local().copy_(local)
    model.init_buffers(device)
    load_buffers(model, read)


@torch.no_grad()
def load_buffers(model: nn.Module, read: Callable[[str], torch.Tensor]) -> None:
    """Persistent buffers the source holds (DeepSeek-V3's expert bias) replace their
    initial values; `read` raises KeyError for the others (MoE's bias a Qwen3-MoE lacks)."""
    saved = set(model.state_dict())
    for name, buf in model.named_buffers():
        if name not in saved:
            continue
        try:
            value = read(clean_name(name))
        except KeyError:
            continue
        buf.copy_(value)
