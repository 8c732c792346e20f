"""Pretrained Hugging Face weights read once per job, not once per rank.

Only global rank 0 reads the checkpoint. Every rank (rank 0 too) builds the architecture on
the meta device, shards it with FSDP2 and allocates just its shards; rank 0 then broadcasts
the full state dict one tensor at a time and each rank keeps its slice. Host memory per node
is then one full copy (on the first node only) plus the shards, instead of one per rank.
Broadcasting from global rank 0, rather than reading on each node's first rank, is what
`set_model_state_dict` supports and spares the other nodes' file systems any read.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from loom.config import JobConfig
from loom.data.loaders import on_node_leaders
from loom.mesh import ParallelDims
from loom.models.hf import HFCausalLM, hf_model_from_config, load_hf_model
from loom.parallel.parallelize import parallelize


def non_persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Buffers the state dict leaves out (rotary frequencies): computed in `__init__`, so
    on the meta device they hold nothing and must be sent as well."""
    saved = set(model.state_dict())
    return [(name, buf) for name, buf in model.named_buffers() if name not in saved]


def receive_weights(model: nn.Module, pretrained: nn.Module | None) -> None:
    """Fill the sharded, materialised `model` from rank 0's `pretrained` (None elsewhere)."""
    full = pretrained.state_dict() if pretrained is not None else {}
    set_model_state_dict(model, full, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=True))
    source = dict(pretrained.named_buffers()) if pretrained is not None else {}
    for name, buf in non_persistent_buffers(model):
        if pretrained is not None:
            buf.copy_(source[name])
        dist.broadcast(buf, src=0)


def build_hf_model(cfg: JobConfig, dims: ParallelDims, device: torch.device,
                   backend: str) -> HFCausalLM:
    """The pretrained model, parallelized, with each rank holding only its shards. A
    checkpoint rank 0 cannot read fails on every rank with rank 0's line."""
    loaded: list[HFCausalLM] = []
    on_node_leaders(lambda: loaded.append(load_hf_model(cfg.model)), leader=dist.get_rank() == 0)
    with torch.device("meta"):
        model = hf_model_from_config(cfg.model, dtype=torch.float32).train()
    parallelize(model, dims, cfg.parallel, loss_parallel=False, backend=backend)
    model.to_empty(device=device)
    with torch.no_grad():
        receive_weights(model, loaded[0] if loaded else None)
    return model
