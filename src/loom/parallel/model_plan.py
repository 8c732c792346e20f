"""What each parallelism acts on in one model, so the recipe never looks inside a model.

A family's parallel plan is part of its one registered record (`ModelSpec.plan`, given at
`loom.models.registry.register`; loom's own families in `loom.families`). A built
model's family is the one its spec recorded on it (`loom.models.registry.for_model`).
"""

from __future__ import annotations

from torch import nn

from loom.models.registry import for_model
from loom.models.spec import ModelPlan, ModelSpec


def model_plan(model: nn.Module, spec: ModelSpec | None = None) -> ModelPlan:
    """The model's plan, carrying its family's spec (`ModelPlan.spec`) so that the recipe
    asks the family nothing more by lookup; `spec`: the family, when the caller has it."""
    spec = for_model(model) if spec is None else spec
    if spec.plan is None:
        raise ValueError(f"the {spec.name} family has no parallel plan: register it with "
                         "loom.models.registry.register(spec, plan=...)")
    plan = spec.plan(model)
    plan.spec = spec
    return plan
