"""What each parallelism acts on in one model, so the recipe never looks inside a model:
the model's family spec (loom.models.registry) answers with a `ModelPlan`."""

from __future__ import annotations

from torch import nn

from loom.models.registry import for_model
from loom.models.spec import ModelPlan


def model_plan(model: nn.Module) -> ModelPlan:
    return for_model(model).plan(model)
