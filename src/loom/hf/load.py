"""Pretrained Hugging Face weights read once per job, one slice at a time.

Every rank builds the architecture on the meta device, shards it with FSDP2 and allocates
just its shards. When the model is a local folder of safetensors files holding every
parameter and persistent buffer under the model's own names (what `save_pretrained` and
`loom export` write), global rank 0 reads each tensor rank by rank, only the slice that
rank holds (`safe_open(...).get_slice`), casts it to the training dtype and sends it:
host memory per node is then the shards (one fp32 copy of the model in all) plus one slice
in flight. Non-persistent buffers (rotary frequencies) are computed on every rank by the
model's own initializer, as `from_pretrained` does in transformers 5. Other checkpoints
(hub ids, `.bin`, renamed keys, older transformers) take the whole-model path: rank 0
loads the model and broadcasts its state dict (`set_model_state_dict(...,
broadcast_from_rank0=True)`). Either way only global rank 0 reads the checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from loom.config import JobConfig, ModelConfig
from loom.data.loaders import on_node_leaders
from loom.hf.checkpoint import HFCheckpoint
from loom.models.hf_folder import read_weights
from loom.models.registry import for_config
from loom.models.transformers.model import (
    HFCausalLM,
    hf_model_from_config,
    hf_source,
    load_hf_model,
)
from loom.parallel.init import clean_name
from loom.parallel.mesh import ParallelDims
from loom.parallel.parallelize import parallelize

logger = logging.getLogger("loom")

Spec = tuple[tuple[int, ...], tuple[int, ...]]
"""A rank's slice of a tensor: its shape and its offset in the full tensor."""


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


def saved_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers under their checkpoint names (a tied weight once),
    in the same order on every rank."""
    seen, found = set(), []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            found.append((name.removeprefix("hf."), tensor))
    return found


def safetensors_files(m: ModelConfig, model: nn.Module) -> dict[str, str] | None:
    """Checkpoint name -> file for every saved tensor of `model`, if a local folder's
    safetensors (headers checked by the folder reader) hold them all with the same shapes;
    None: take the whole-model path. Needs transformers 5, whose `initialize_weights`
    computes just the unsaved buffers."""
    import transformers

    folder = Path(m.model).expanduser()
    if int(transformers.__version__.split(".")[0]) < 5 or not folder.is_dir():
        return None
    tensors = read_weights(folder)
    for name, tensor in saved_tensors(model):
        if name not in tensors or tensors[name].shape != tuple(tensor.shape):
            return None
    return {name: str(info.file) for name, info in tensors.items()}


def local_spec(tensor: torch.Tensor) -> Spec:
    if isinstance(tensor, DTensor):
        return compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                     tensor.placements)
    return tuple(tensor.shape), (0,) * tensor.dim()


def stream_weights(model: nn.Module, files: dict[str, str]) -> None:
    """Fill every rank's shards from the safetensors `files` (read on rank 0 only): per
    tensor, rank 0 reads each rank's slice and sends it. The file is opened per tensor so
    that no memory-mapped page of it stays resident beyond that tensor."""
    from safetensors import safe_open

    tensors = saved_tensors(model)
    specs: list[list[Spec]] | None = [[] for _ in range(dist.get_world_size())] \
        if dist.get_rank() == 0 else None
    dist.gather_object([local_spec(t) for _, t in tensors], specs, dst=0)
    for i, (name, tensor) in enumerate(tensors):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if specs is None:
            if local.numel():  # straight into the shard (contiguous in FSDP2): no copy
                dist.recv(local, src=0)
            continue
        with safe_open(files[name], "pt", device="cpu") as f:
            source = f.get_slice(name)
            for rank, (shape, offset) in enumerate(s[i] for s in specs):
                if 0 in shape:
                    continue
                where = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
                piece = (source[where] if shape else f.get_tensor(name)).to(local.dtype)
                if rank == 0:
                    local.copy_(piece)
                else:
                    dist.send(piece.to(local.device), dst=rank)


def to_empty_keeping_ties(model: nn.Module, device: torch.device) -> None:
    """`model.to_empty`, with weights that several modules share (tied embeddings) still
    shared: `to_empty` gives each module its own new tensor, which FSDP2's units avoid by
    holding one parameter, but an unwrapped model (one process) would train two."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)
    for (first, first_name), *others in (o for o in owners.values() if len(o) > 1):
        for module, name in others:
            setattr(module, name, getattr(first, first_name))


def compute_non_persistent_buffers(model: HFCausalLM) -> None:
    """Run the model's initializer for what the checkpoint does not hold, as
    `from_pretrained` does: every saved tensor is marked initialized, so only the
    non-persistent buffers are computed."""
    for _, tensor in saved_tensors(model):
        tensor._is_hf_initialized = True
    model.hf.initialize_weights()


def build_hf_model(cfg: JobConfig, dims: ParallelDims, device: torch.device,
                   backend: str) -> HFCausalLM:
    """The pretrained model, parallelized, with each rank holding only its shards. A
    checkpoint rank 0 cannot read fails on every rank with rank 0's line."""
    with torch.device("meta"):
        model = hf_model_from_config(cfg.model, dtype=torch.float32).train()
    leader = dist.get_rank() == 0
    plan: list[dict[str, str] | None] = [None]
    on_node_leaders(lambda: plan.__setitem__(0, safetensors_files(cfg.model, model)), leader)
    dist.broadcast_object_list(plan, src=0)
    files = plan[0]
    loaded: list[HFCausalLM] = []
    if files is None:
        logger.info("HF weights: not a local safetensors folder under the model's own names; "
                    "rank 0 loads the whole model and broadcasts it")
        on_node_leaders(lambda: loaded.append(load_hf_model(cfg.model)), leader)
    parallelize(model, dims, cfg.parallel, loss_parallel=False, backend=backend)
    to_empty_keeping_ties(model, device)
    with torch.no_grad():
        if files is None:
            receive_weights(model, loaded[0] if loaded else None)
        else:
            compute_non_persistent_buffers(model)
            stream_weights(model, files)
    return model


def local_folder(m: ModelConfig) -> Path:
    """The model's folder on this machine: a local one as given, a hub id's snapshot of its
    safetensors and JSON files (fetched by the caller's node leader, cached for the rest)."""
    source = hf_source(m.model, probe=False)
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download  # optional: only hub ids reach here

    return Path(snapshot_download(source, allow_patterns=["*.safetensors", "*.json"]))


def open_native_checkpoint(cfg: JobConfig, model: nn.Module) -> HFCheckpoint:
    """The checkpoint a native import reads, checked once by global rank 0 against `model`
    (the meta-built whole model) before any rank allocates: a missing shard or tensor, or
    a shape its config.json does not imply, fails every rank with rank 0's one line."""
    spec = for_config(cfg.model)
    args = spec.args_from_config(cfg.model)
    opened: list[HFCheckpoint] = []

    def open_and_check() -> None:
        checkpoint = HFCheckpoint(local_folder(cfg.model), spec.hf[0], args)
        checkpoint.check(model, clean_name)
        opened.append(checkpoint)

    on_node_leaders(open_and_check, leader=dist.get_rank() == 0)
    return opened[0] if opened else HFCheckpoint(local_folder(cfg.model), spec.hf[0], args)
