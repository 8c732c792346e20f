"""One step from the validated flags to the final, frozen config the trainer uses.

Flags, environment, preset and --config file were merged and checked by `loom.config`;
what only the started job can know is added here, in this order: the run settings of the
checkpoint being resumed, the seed they fix, the precision this device supports, a Hugging
Face model's own shape, the tokenizer's vocabulary (and the document mask chat data needs)
and the loss the mesh allows. The result is checked once, after all of them; nothing
downstream rewrites it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from loom.checkpoint import resume as resuming
from loom.checkpoint.resume import ResumePoint
from loom.config import ConfigError, JobConfig, validate
from loom.config.resolved import applied, settled
from loom.config.sources import fit_transformers_model
from loom.config.uses import refuse_unused
from loom.data.loaders import build_datasets
from loom.hf.lora_base import lora_base_facts
from loom.hf.model_config import hf_model_shape
from loom.lora.converter import apply_lora, lora_targets_for, settings
from loom.losses import loss_impl_for
from loom.models.resolve import model_args, model_choice, plain_model
from loom.numerics.precision import Precision, resolve_precision
from loom.parallel.cuda_graphs import cuda_graphs_refusal, graphs_compile_mode
from loom.parallel.mesh import ParallelDims
from loom.runtime.distributed import RankInfo, seed_everything
from loom.runtime.preflight import available_memory_bytes, check_model_fits

logger = logging.getLogger("loom")


@dataclass(frozen=True)
class Resolved:
    """The final config and what was learned while making it."""

    cfg: JobConfig
    precision: Precision
    resume: ResumePoint | None
    dataset: Any
    """The training set (or a stream spec), whose tokenizer sized the vocabulary."""
    val_datasets: dict[str, Any]
    """The validation sets by name (the default set's name is "")."""


def resolve_model(cfg: JobConfig) -> JobConfig:
    """`cfg` with the implementation of its Hugging Face --model decided (`model_choice`),
    once per run, before the mesh is built: transformers' module runs at tp 1 and recomputes
    whole blocks. Other models, and a config already resolved, pass unchanged."""
    choice = model_choice(cfg)
    if not choice:
        return cfg
    cfg = settled(cfg, **choice)
    refuse_unused(cfg, cfg.explicit)  # the folder's family is known now
    return fit_transformers_model(cfg) if cfg.model.runs_transformers else cfg


def restarted(cfg: JobConfig, restarts: int) -> JobConfig:
    """`cfg` of a job restarted `restarts` times: it continues its own run folder
    (`resume_after_restart`)."""
    resume, note = resuming.resume_after_restart(cfg, restarts)
    return settled(cfg, notes=(note,) if note else (),
                   **({"resume": resume} if resume else {}))


def check_fits(cfg: JobConfig, dims: ParallelDims, device: torch.device) -> None:
    """Fail in one line, before the model is allocated, on a model too large for this
    device (the vocabulary is the settled one: the tokenizer's where it replaced the flag)."""
    if cfg.model.runs_transformers:
        return
    with torch.device("meta"):
        model = plain_model(cfg)
        if cfg.lora.lora_rank:  # the adapters train; the weights they freeze hold no state
            apply_lora(model, settings(cfg))
    n_params = sum(p.numel() for p in model.parameters())
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = available_memory_bytes() if device.type == "cpu" else None
    check_model_fits(n_params, dims.dp_shard * dims.cp * dims.tp, free, buffers, frozen)


def check(cfg: JobConfig, dims: ParallelDims, device: torch.device,
          resume: ResumePoint | None) -> None:
    """The one check of the settled config: validation (the same a flag meets at parse
    time, now with every fact in), then what needs the device or the layout: the model's
    memory, CUDA graphs, a resumed checkpoint's architecture."""
    validate(cfg)
    check_fits(cfg, dims, device)
    if cfg.parallel.cuda_graphs:  # needs the device and the layout: refused here, not earlier
        refusal = cuda_graphs_refusal(cfg, dims, device.type)
        if refusal is not None:
            raise ConfigError(refusal)
    if resume is not None:  # before the model is built
        resuming.check_architecture(resume.saved["architecture"],
                                    resuming.architecture(cfg, model_args(cfg)),
                                    cfg.checkpoint.resume_change_model)


def resolve(flags: JobConfig, info: RankInfo, dims: ParallelDims, device: torch.device,
            outdir: Path) -> Resolved:
    """The final config of a job whose process group and mesh are up (collective: rank 0
    reads checkpoints and HF configs and shares them, each node tokenizes once).

    Settle, then check, once: every fact start-up learns (resumed settings, precision, the
    Hugging Face shape, LoRA's targets, the data's vocabulary and document mask, the
    effective loss) is in the config before `check` sees it, so no refusal can be bypassed
    by a fact learned later (chat data turning --doc-mask on, say). What follows the check
    only derives from what it passed (the compile mode CUDA graphs record with)."""
    resume = resuming.find_resume(flags.checkpoint.resume, outdir)
    cfg = flags if resume is None else settled(
        flags, **resuming.saved_settings(flags, resume.saved, resume.path))
    seed_everything(cfg.train.seed)
    precision = resolve_precision(cfg.parallel.dtype, device)
    logger.info("precision: %s (%s)", precision.dtype, precision.reason)
    cfg = replace(cfg, parallel=replace(cfg.parallel, dtype=precision.dtype))
    if cfg.model.from_hub_format and cfg.model.model_impl_reason is None:
        raise ValueError("the mesh was built before the model was resolved; call "
                         "loom.trainer.resolve.resolve_model on the flags first")
    cfg = settled(cfg, **hf_model_shape(cfg, info.local_rank))
    cfg = settled(cfg, lora_targets=lora_targets_for(cfg), **lora_base_facts(cfg))
    dataset, val_datasets, learned = build_datasets(cfg, info.local_rank)
    cfg = applied(cfg, learned)
    cfg = settled(cfg, loss_impl=loss_impl_for(cfg))  # effective --loss-impl, before tp
    check(cfg, dims, device, resume)
    if cfg.parallel.cuda_graphs:
        cfg = settled(cfg, compile_mode=graphs_compile_mode(cfg.parallel))
    return Resolved(cfg, precision, resume, dataset, val_datasets)
