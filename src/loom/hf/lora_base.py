"""Which frozen base a LoRA run's adapters were trained on, recorded so that nothing later
merges or trains them on another.

A LoRA checkpoint holds the adapters only; resume, `loom export`, `loom eval` and `loom
generate` read the base again from the run's source. The record (`--lora-base`, set by
loom, kept in config.json and in every checkpoint's architecture) is `sha256:<digest>` of
the `--model` folder's weight files (the safetensors and their index, digested as `loom
digest` digests a checkpoint's files), or `init:<seed>` for loom's init drawn from the
seed. A base whose record no longer matches is refused in one line naming both.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from loom.checkpoint.digest import files_digest
from loom.config import ConfigError, JobConfig, ModelConfig
from loom.hf.load import local_folder
from loom.models.hf_folder import INDEX, SINGLE, weight_files


def base_files(folder: Path) -> list[Path]:
    """The weight files a run reads from a Hugging Face folder (the index too)."""
    shards = sorted(set(weight_files(folder).values()))
    return [folder / INDEX, *shards] if shards else [folder / SINGLE]


def base_record(source: str | None, seed: int) -> str:
    """The record of the base a LoRA run reads from `source` (its --model) and `seed`."""
    if source is None or not ModelConfig(model=source).from_hub_format:
        return f"init:{seed}"
    try:
        return f"sha256:{files_digest(base_files(local_folder(ModelConfig(model=source))))}"
    except (OSError, ValueError) as e:
        raise ConfigError(f"the base of this LoRA run, {source}, cannot be read: "
                          f"{e}") from None


def lora_base_facts(cfg: JobConfig) -> dict[str, str]:
    """`{lora_base: record}` of a LoRA run, digested once, by rank 0, and shared
    (collective); {} without LoRA. A record the user gave must be the base's."""
    if not cfg.lora.lora_rank:
        return {}
    found: list[object] = [None]
    if dist.get_rank() == 0:
        try:
            found[0] = base_record(cfg.model.model, cfg.train.seed)
        except ConfigError as e:
            found[0] = e
    dist.broadcast_object_list(found, src=0)
    if isinstance(found[0], ConfigError):
        raise found[0]
    record = str(found[0])
    given = cfg.lora.lora_base
    if "lora_base" in cfg.explicit and given != record:
        source = cfg.model.model or "loom init"
        raise ConfigError(f"--lora-base {given}: the base this run reads, {source}, is "
                          f"{record}")
    return {"lora_base": record}


def check_base(recorded: str | None, source: str | None, seed: int, checkpoint: Path) -> None:
    """The base a checkpoint's adapters were trained on (`recorded`; None: a checkpoint
    written before bases were recorded) is the one its run's source holds now."""
    if recorded is None:
        return
    now = base_record(source, seed)
    if now != recorded:
        raise ConfigError(f"the base of checkpoint {checkpoint}, {source or 'loom init'}, "
                          f"changed since its adapters were trained: it is {now}, they were "
                          f"trained on {recorded}")
