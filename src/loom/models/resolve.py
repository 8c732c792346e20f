"""The model a config describes: which family builds it (decided once, here:
`model_choice`), its arguments (taken from the config fields of the same name) and the
unparallelized module."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import nn

from loom.config import ConfigError, JobConfig
from loom.config.families import group_fields
from loom.config.resolved import refuse_replaced
from loom.data.hub import first_line
from loom.models.hf_folder import CONFIG, open_folder, read_config
from loom.models.registry import families, for_architectures, for_config
from loom.models.transformers.model import LOCAL_MODEL_HINT, hf_source
from loom.models.transformers.spec import LIMITS, recorded_args

logger = logging.getLogger("loom")

BEHAVIOUR_FIELDS = ("load_balance_coeff", "aux_loss_coeff")
"""Fields an import fills (the checkpoint has no such setting) but an explicit flag keeps."""


def from_source_flags() -> tuple[str, ...]:
    """Family flags whose unset value (None) means "the model's source says": a folder
    fills them, but one the user set wins (DeepSeek-V3's widths; a shape that then differs
    from the folder's weights is refused when they are read)."""
    return tuple(name for name, (_, f) in group_fields().items() if f.default is None)


def model_args(cfg: JobConfig) -> Any:
    """The arguments of the config's family (a frozen dataclass), as checkpoints record them;
    transformers' module records loom's dense fields filled from its config (its shape)."""
    if cfg.model.runs_transformers:
        return recorded_args(cfg.model)
    return for_config(cfg.model).args_from_config(cfg.model)


def plain_model(cfg: JobConfig) -> nn.Module:
    """The unparallelized model on the current device (a transformers-path model: its
    architecture with fresh weights)."""
    spec = for_config(cfg.model)
    return spec.new(spec.args_from_config(cfg.model))


def hub_config(name: str) -> dict[str, Any]:
    """A Hugging Face model's config.json, checked by the one folder reader: a local
    folder's, its safetensors headers checked too (so `loom plan` refuses what `loom train`
    would), or the hub's, cached. Read as data with caps: nothing in it runs."""
    source = hf_source(name)
    if Path(source).is_dir():
        return open_folder(Path(source)).config
    from huggingface_hub import hf_hub_download  # optional: only hub ids reach here

    try:
        path = Path(hf_hub_download(source, CONFIG))
    except (OSError, ValueError) as e:  # offline and not cached, gated, no such repo
        raise ConfigError(f"--model {name}: cannot fetch its config.json "
                          f"({first_line(e)}); {LOCAL_MODEL_HINT}") from None
    return read_config(path)


TRANSFORMERS_LACKS = ("tp", "pp", "cp", "ep")
"""Parallel degrees transformers' module cannot take (its LIMITS): above 1, an `auto` that
would fall back to it refuses instead of running a different layout."""


def fall_back(cfg: JobConfig, why: str) -> dict[str, Any]:
    """The model settings of transformers' module, `why` recorded; one info line names what
    that path cannot do. Under `auto`, flags that need a native family refuse in one line."""
    m, p = cfg.model, cfg.parallel
    if m.model_impl == "auto":
        needs = [f"--{d} {getattr(p, d)}" for d in TRANSFORMERS_LACKS if getattr(p, d) > 1]
        if needs:
            raise ConfigError(f"--model {m.model}: {why}, so --model-impl auto takes "
                              f"transformers' module, which cannot run {', '.join(needs)}; "
                              "drop it or pick a model a native family serves")
    logger.info("model %s: transformers' module (%s); that path cannot use %s", m.model,
                why, LIMITS)
    return {"model_impl": "transformers", "model_impl_reason": why}


def model_choice(cfg: JobConfig) -> dict[str, Any]:
    """For a Hugging Face --model, which implementation runs it and why, as model settings
    by flag name: a native family (its shape filled from config.json) where one serves the
    architecture and --model-impl allows, else transformers' module. None for other models
    and for a choice already made (`loom.trainer.resolve.resolve_model` settles it)."""
    m = cfg.model
    if not m.from_hub_format or m.model_impl_reason is not None:
        for_config(m)  # an unknown --family fails here, in one line
        return {}
    hf = hub_config(m.model)
    architectures = hf.get("architectures") or []  # checked: a list of names
    found = for_architectures(architectures)
    served = sorted({a for s in families() for adapter in s.hf for a in adapter.architectures})
    shown = ", ".join(architectures) or "no architecture"
    if m.model_impl == "native" and found is None:
        raise ConfigError(f"--model-impl native: no native family serves {shown} (native: "
                          f"{', '.join(served)}); use --model-impl auto or transformers")
    if m.model_impl == "transformers":
        return fall_back(cfg, "--model-impl transformers")
    if found is None:
        return fall_back(cfg, f"no native family serves {shown}")
    spec, adapter = found
    try:
        fields = adapter.fields_from_hf(hf)
    except ConfigError:  # the folder is bad (a field's type or range), not unsupported
        raise
    except (ValueError, KeyError, TypeError) as e:
        if m.model_impl == "native":
            raise ConfigError(f"--model {m.model}: {shown} with {e} has no native "
                              "equivalent; pass --model-impl transformers or auto") from None
        return fall_back(cfg, f"loom's {spec.name} family has no {e} ({shown})")
    for name in (*BEHAVIOUR_FIELDS, *from_source_flags()):
        if name in cfg.explicit:
            fields.pop(name, None)
    refuse_replaced(cfg, {**fields, "family": spec.name}, f"--model {m.model}'s {CONFIG}")
    if cfg.data.seq_len > fields["max_seq_len"]:
        raise ConfigError(f"--seq-len {cfg.data.seq_len} exceeds the model's "
                          f"max_position_embeddings {fields['max_seq_len']}")
    why = f"{shown} is served by loom's {spec.name} family"
    logger.info("model %s: native (%s)", m.model, why)
    return {**fields, "model_impl": "native", "family": spec.name, "model_impl_reason": why}
