"""Model families by name (a built model carries its own) and by Hugging Face architecture.

loom's own families are registered here; a family defined elsewhere (a test, a user's
package imported before training) calls `register` once and is then used like them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from loom.config import ConfigError, ModelConfig
from loom.models.deepseek_v3.spec import DEEPSEEK_V3
from loom.models.llama.spec import LLAMA
from loom.models.moe.spec import MOE
from loom.models.qwen3.spec import QWEN3, QWEN3_MOE
from loom.models.spec import FAMILY_ATTR, HFAdapter, ModelSpec
from loom.models.transformers.spec import TRANSFORMERS

_FAMILIES: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    """Add a family (replacing one of the same name)."""
    _FAMILIES[spec.name] = spec
    return spec


def family(name: str) -> ModelSpec:
    if name not in _FAMILIES:
        raise ConfigError(f"--family {name}: no such model family; choose one of "
                          f"{', '.join(sorted(_FAMILIES))}")
    return _FAMILIES[name]


def family_name(m: ModelConfig) -> str:
    """The family a resolved model config builds."""
    if m.runs_transformers:
        return TRANSFORMERS.name
    return m.family or ("moe" if m.n_experts else "llama")


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


for _spec in (LLAMA, QWEN3, MOE, QWEN3_MOE, DEEPSEEK_V3, TRANSFORMERS):
    register(_spec)
