"""Model families by name (a built model carries its own) and by Hugging Face architecture.

The registry is filled by `register`, once per family: loom's own in
`loom/families.py` (above both the models and their parallel plans), a family
defined elsewhere (a test, a user's package imported before training) by its own module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from torch import nn

from loom.config import ConfigError, ModelConfig
from loom.config.families import flag_groups, register_flags
from loom.config.presets import register_presets
from loom.config.uses import register_uses
from loom.models.spec import FAMILY_ATTR, HFAdapter, ModelPlan, ModelSpec, Routing

_FAMILIES: dict[str, ModelSpec] = {}


def register(spec: ModelSpec, plan: Callable[[nn.Module], ModelPlan] | None = None
             ) -> ModelSpec:
    """Add a family, one record (replacing one of the same name): its spec with its parallel
    plan, and its flags with `loom.config`. loom's own register in
    `loom/families.py`; a family of yours from any module imported before the run
    (`tests/families/gpt2.py`)."""
    if plan is not None:
        spec = replace(spec, plan=plan)
    for group in spec.flags:
        register_flags(group)
    register_presets(spec.name, spec.presets, spec.aliases)
    register_uses(spec.name, spec.uses, own=spec.model_cls.__module__.startswith("loom."))
    _FAMILIES[spec.name] = spec
    return spec


def family(name: str) -> ModelSpec:
    if not _FAMILIES:  # loom's own register in loom.families (above models/)
        raise ConfigError(f"--family {name}: no model family is registered yet; import "
                          "loom.parallel (which registers loom's families) before building "
                          "a model")
    if name not in _FAMILIES:
        raise ConfigError(f"--family {name}: no such model family; choose one of "
                          f"{', '.join(sorted(_FAMILIES))}")
    return _FAMILIES[name]


DEFAULT_FAMILY = "llama"
"""What --family is when unset and no family's flags imply another."""


def family_name(m: ModelConfig) -> str:
    """The family a resolved model config builds: --family, else the family a flag group's
    `implied_family` names (MoE's: --n-experts > 0), else the default."""
    if m.runs_transformers:
        return "transformers"  # transformers' own module (loom.models.transformers)
    if m.family:
        return m.family
    for group in flag_groups():
        implied = getattr(group, "implied_family", None)
        name = None if implied is None else implied(m.flags_of(group))
        if name is not None:
            return name
    return DEFAULT_FAMILY


def routing_of(m: ModelConfig) -> Routing | None:
    """The routed experts' shape of the model a config builds (None: dense), from its
    family's spec."""
    spec = for_config(m)
    return spec.routing(spec.args_from_config(m))


def for_config(m: ModelConfig) -> ModelSpec:
    return family(family_name(m))


def for_model(model: nn.Module) -> ModelSpec:
    """The spec of a built model (or pipeline stage): the family whose name `ModelSpec.new`
    recorded on it (a Qwen3 model is "qwen3", though its class is Llama's); a model built
    by hand, unmarked, by the first family registered for its class or a base class."""
    name = getattr(model, FAMILY_ATTR, None)
    if isinstance(name, str):
        return family(name)
    for cls in type(model).__mro__:
        for spec in _FAMILIES.values():
            if spec.model_cls is cls:
                return spec
    raise TypeError(f"no model family is registered for {type(model).__name__}")


def spec_of(model: nn.Module) -> ModelSpec | None:
    """`for_model`, or None for a module no family built (a container of pipeline stages)."""
    try:
        return for_model(model)
    except (TypeError, ConfigError):
        return None


def output_of(model: nn.Module) -> nn.Module | None:
    """The output projection of a family's model (None: none, or not a family's model)."""
    spec = spec_of(model)
    return None if spec is None else spec.output(model)


def named_part(model: nn.Module, which: str) -> nn.Module | None:
    """A model's `embedding` or `output` module as its family names it (None where the
    family has none or a pipeline stage does not hold it)."""
    parts = for_model(model).parts
    name = None if parts is None else getattr(parts, which)
    return None if name is None else getattr(model, name, None)


def for_architectures(architectures: Iterable[str]) -> tuple[ModelSpec, HFAdapter] | None:
    """The native family and adapter that read a config.json's `architectures`, if any."""
    for arch in architectures:
        for spec in _FAMILIES.values():
            for adapter in spec.hf:
                if arch in adapter.architectures:
                    return spec, adapter
    return None


def export_adapter(spec: ModelSpec, args: Any) -> HFAdapter:
    """The Hugging Face architecture a model exports to: the first adapter, of its family
    or of another family built from the same modules, that reproduces it exactly; else a
    ConfigError naming what has no equivalent."""
    candidates = [*spec.hf, *(a for s in _FAMILIES.values() if s is not spec
                               and s.model_cls is spec.model_cls for a in s.hf)]
    refusals = []
    for adapter in candidates:
        why = adapter.export_refusal(args)
        if why is None:
            return adapter
        refusals.append(f"{adapter.architectures[0]}: {why}")
    if not candidates:
        raise ConfigError(f"the {spec.name} family has no Hugging Face architecture")
    raise ConfigError("no Hugging Face architecture reproduces this model ("
                      + "; ".join(refusals) + ")")


def families() -> list[ModelSpec]:
    return list(_FAMILIES.values())

