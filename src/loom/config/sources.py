"""Where settings come from, lowest precedence first: defaults < preset < environment <
--config file < flags. The environment is read here only, from each field's `env` name."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import Field, replace
from typing import Any

from loom.config.job import SECTIONS, JobConfig, flag_fields, with_settings
from loom.config.presets import is_hf_model, resolve_preset
from loom.config.uses import refuse_unused
from loom.config.validate import knob_warnings, validate
from loom.errors import ConfigError


def _resolve_sharding_strategy(explicit: dict[str, Any], warnings: list[str]) -> None:
    """Map the deprecated --sharding-strategy onto --reshard-after-forward."""
    strategy = explicit.pop("sharding_strategy", None)
    if strategy is None:
        return
    key = strategy.lower()
    if key == "full_shard":
        explicit.setdefault("reshard_after_forward", "always")
    elif key in ("shard_grad_op", "no_shard"):
        explicit.setdefault("reshard_after_forward", "never")
        warnings.append(f"--sharding-strategy {strategy} is deprecated; "
                        "use --reshard-after-forward never")
        if key == "no_shard":
            warnings.append("--sharding-strategy no_shard: parameters stay sharded "
                            "(FSDP2 has no unsharded mode); only resharding is turned off")
    elif key in ("hybrid_shard", "hybrid_shard_zero2"):
        raise ConfigError(f"--sharding-strategy {strategy} is not supported; "
                          "use --dp-replicate R --dp-shard S for HSDP")
    else:
        raise ConfigError(f"unknown --sharding-strategy {strategy!r}; "
                          "use --reshard-after-forward {always,never}")


SYNONYMS = {"float32": "fp32", "bfloat16": "bf16"}
"""Other spellings an environment variable may use for a choice (torch's dtype names)."""
COMMA_LISTS = ("hist", "hist_layers")
"""Settings that are comma-separated lists: an environment value may space its commas."""
PATH_SETTINGS = ("outdir", "resume")
"""Folders loom writes to or restores from: `~` is expanded wherever they were given (a
shell expands `--outdir ~/x` but neither `--outdir=~/x` nor a TOML or environment value),
and relative ones stay relative to the working directory, as a flag's are."""


def _from_environment(name: str, f: Field, raw: str) -> Any:
    """One variable's value, typed and checked like the flag (a bad value is an error)."""
    kind = f.metadata["type"] or type(f.default)
    if kind is bool:
        value = raw.strip().lower()
        if value not in ("0", "1", "true", "false"):
            raise ConfigError(f"{name} must be 0 or 1, got {value!r}")
        return value in ("1", "true")
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
    if kind is float:  # its range is checked with the flags' (`loom.config.numbers`)
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{name} must be a number, got {raw!r}") from None
    choices = f.metadata["choices"]
    if choices:
        value = SYNONYMS.get(raw.strip().lower(), raw.strip().lower())
        if value not in choices:
            raise ConfigError(f"{name} must be {' or '.join(choices)}, got {raw!r}")
        return value
    return raw.replace(" ", "") if f.name in COMMA_LISTS else raw


def environment_settings(environ: Mapping[str, str]) -> dict[str, Any]:
    """{field name: value} of every field whose `env` variable is set (an empty path or list
    counts as unset)."""
    out: dict[str, Any] = {}
    for name, (_, f) in flag_fields().items():
        env = f.metadata["env"]
        if env is None or env not in environ:
            continue
        value = _from_environment(env, f, environ[env])
        if value != "":
            out[name] = value
    return out


def fit_transformers_model(cfg: JobConfig) -> JobConfig:
    """transformers' own module has no TP plan and no attention child to recompute alone: it
    runs at tp 1 (an explicit --dp-shard takes the tp ranks) and recomputes whole blocks."""
    p, warnings = cfg.parallel, list(cfg.warnings)
    if p.tp != 1:
        p = replace(p, tp=1, dp_shard=p.dp_shard * p.tp if p.dp_shard > 0 else p.dp_shard)
        warnings.append(f"--tp {cfg.parallel.tp} ignored for transformers' module of "
                        f"{cfg.model.model} (loom's tensor-parallel plans are for its native "
                        "families); its ranks shard data instead")
    if p.activation_checkpoint in ("selective", "op"):
        warnings.append(f"--ac {p.activation_checkpoint} on transformers' module: its own "
                        "gradient checkpointing recomputes whole blocks (--ac block)")
        p = replace(p, activation_checkpoint="block")
    return replace(cfg, parallel=p, warnings=tuple(warnings))


def config_from_flags(explicit: Mapping[str, Any], environ: Mapping[str, str] | None = None,
                      from_file: Mapping[str, Any] | None = None) -> JobConfig:
    """Build the job config: defaults < preset < environment < --config file < explicit
    flags; then validate."""
    environ = os.environ if environ is None else environ
    budget_given = "act_mem_budget" in explicit
    flagged = set(explicit)  # a file's values are settings, not flags given again on resume
    explicit = {**(from_file or {}), **explicit}
    warnings: list[str] = []
    _resolve_sharding_strategy(explicit, warnings)
    values: dict[str, Any] = {}
    preset: dict[str, Any] = {}
    model_name = explicit.get("model")
    if model_name is not None and not is_hf_model(model_name):
        try:
            canonical, preset = resolve_preset(model_name)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        values.update(preset)
        explicit["model"] = canonical
    environment = environment_settings(environ)
    values.update(environment)
    given = {*environment, *flagged}
    values.update(explicit)
    for name, (_, f) in flag_fields().items():
        if f.metadata["repeat"] and isinstance(values.get(name), list):
            values[name] = tuple(values[name])  # argparse's append list; frozen config
    for name in PATH_SETTINGS:
        if isinstance(values.get(name), str):
            values[name] = os.path.expanduser(values[name])
    if values.get("activation_checkpoint") == "full":
        values["activation_checkpoint"] = "block"
    sections = flag_fields()
    by_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for name, value in values.items():
        if name not in sections:  # a preset's family flag, the family not yet registered
            raise ConfigError(f"--{name.replace('_', '-')}: no registered model family declares "
                              "it (import loom.parallel, which registers loom's families, or "
                              "the module registering yours, before building a config)")
        by_section[sections[name][0]][name] = value
    cfg = JobConfig(**{s: SECTIONS[s]()  # type: ignore[misc]
                       for s in SECTIONS}, warnings=tuple(warnings))
    for section, settings in by_section.items():
        cfg = with_settings(cfg, section, settings)
    warnings += knob_warnings(cfg.parallel, budget_given=budget_given)
    cfg = replace(cfg, warnings=tuple(warnings), explicit=tuple(sorted(given)))
    if cfg.model.runs_transformers:
        cfg = fit_transformers_model(cfg)
    # a file's value counts as set where it differs from the preset's or the default
    filed = {k for k, v in (from_file or {}).items()
             if k in sections and v != preset.get(k, sections[k][1].default)}
    refuse_unused(cfg, given | filed)
    validate(cfg)
    return cfg
