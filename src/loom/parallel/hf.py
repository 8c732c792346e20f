"""Hugging Face models: resolved once per node, then sharded like loom's own model.

The recipe is parallelize_llama's without TP (config resolution forced tp to 1): the
model's own gradient-checkpointing switch for --ac, per-block compile, one FSDP2 unit per
decoder block, then the root (which keeps tied embedding and output weights together).
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from loom.config import ConfigError, JobConfig, ParallelConfig
from loom.data.loaders import on_node_leaders
from loom.mesh import ParallelDims
from loom.models.hf import HFCausalLM, is_hf, load_hf_config, with_hf_config
from loom.parallel.compile import compile_kwargs, set_act_mem_budget
from loom.parallel.fsdp import mixed_precision, set_gradient_division
from loom.precision import describe

logger = logging.getLogger("loom")


def resolve_hf_model(cfg: JobConfig, local_rank: int) -> JobConfig:
    """`cfg` with the HF model's shape (no-op for loom's models). Each node's first rank
    checks the source and fetches the config while the others wait, so every rank fails
    together, with one line, when the model cannot be had."""
    if not is_hf(cfg.model):
        return cfg
    on_node_leaders(lambda: load_hf_config(cfg.model), leader=local_rank == 0)
    return with_hf_config(cfg, load_hf_config(cfg.model, cached=True))


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The decoder's block list: of the ModuleLists not nested in another one (which drops
    an MoE layer's expert list), the one holding the most parameters (a vision tower's
    blocks lose to the language model's)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    outer = [m for name, m in lists
             if not any(name.startswith(f"{other}.") for other, _ in lists)]
    if not outer:
        raise ValueError(f"{type(model).__name__} has no list of decoder blocks to shard")
    return max(outer, key=lambda m: sum(p.numel() for p in m.parameters()))


def apply_hf_ac(model: HFCausalLM) -> None:
    """The model's own activation checkpointing, which recomputes each decoder block in
    backward; non-reentrant, which composes with FSDP2's hooks and compiled blocks.
    transformers 5 renamed `gradient_checkpointing_enable`; the old name warns there."""
    hf, kwargs = model.hf, {"use_reentrant": False}
    if not hf.supports_gradient_checkpointing:
        raise ConfigError(f"{type(hf).__name__} has no activation checkpointing; drop --ac")
    if hasattr(hf, "activation_checkpointing_enable"):
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def apply_hf_compile(blocks: nn.ModuleList, cfg: ParallelConfig) -> None:
    """Compile each block in place (state-dict keys unchanged). Not fullgraph: a graph break
    in code loom does not own should cost speed, not the run."""
    set_act_mem_budget(cfg.act_mem_budget)
    kwargs = {**compile_kwargs(cfg.compile_mode, cfg.compile_backend), "fullgraph": False}
    for block in blocks:
        block.compile(**kwargs)


def apply_hf_fsdp(model: nn.Module, blocks: nn.ModuleList, dims: ParallelDims,
                  cfg: ParallelConfig) -> list[FSDPModule]:
    """One unit per block, then the root with everything else (embeddings, final norm, head)."""
    kwargs = dict(mesh=dims.fsdp_mesh, reshard_after_forward=cfg.reshard_after_forward == "always",
                  mp_policy=mixed_precision(cfg.dtype, cfg.reduce_dtype))
    units = [fully_shard(block, **kwargs) for block in blocks]
    return [*units, fully_shard(model, **kwargs)]


def parallelize_hf(model: HFCausalLM, dims: ParallelDims, cfg: ParallelConfig,
                   backend: str) -> HFCausalLM:
    """Apply AC, compile and FSDP2/HSDP to a HF model, in place: a meta-device one gets
    meta shards (to be materialised and filled), a CPU-resident one real shards on the
    mesh's device."""
    if dims.tp_enabled:
        raise ValueError("a Hugging Face model runs at tp 1 (config resolution forces it)")
    blocks = decoder_blocks(model)
    if cfg.activation_checkpoint != "none":
        apply_hf_ac(model)
    if cfg.compile:
        apply_hf_compile(blocks, cfg)
    units = apply_hf_fsdp(model, blocks, dims, cfg)
    if cfg.grad_divide_factor:
        set_gradient_division(units, dims.dp_size, backend, shard_size=dims.dp_shard)
    logger.info("Hugging Face %s: %d blocks, AC %s, compile %s; FSDP2 %d units over %s mesh "
                "%s, reshard after forward: %s, %s", type(model.hf).__name__, len(blocks),
                cfg.activation_checkpoint, cfg.compile_backend if cfg.compile else "off",
                len(units), "HSDP" if dims.dp_replicate_enabled else "dp_shard",
                tuple(dims.fsdp_mesh.shape), cfg.reshard_after_forward,
                describe(cfg.dtype, cfg.reduce_dtype))
    return model
