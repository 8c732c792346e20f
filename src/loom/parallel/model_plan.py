"""What each parallelism acts on in one model, so the recipe never looks inside a model.

A family's parallel plan is registered here under the family's name (models never import
the parallel code; this registry, above both, joins them): loom's own families below, a
family defined elsewhere (a test, a user's package) with `register_plan`. A built model's
family is the one its spec recorded on it (`loom.models.registry.for_model`).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from loom.models.registry import for_model
from loom.models.spec import ModelPlan
from loom.parallel.deepseek_v3_plan import deepseek_v3_plan
from loom.parallel.hf import transformers_plan
from loom.parallel.llama_plan import dense_plan
from loom.parallel.moe_plan import moe_plan

Plan = Callable[[nn.Module], ModelPlan]
_PLANS: dict[str, Plan] = {}


def register_plan(family: str, plan: Plan) -> Plan:
    """The parallel plan of the family named `family` (replacing an earlier one)."""
    _PLANS[family] = plan
    return plan


def model_plan(model: nn.Module) -> ModelPlan:
    spec = for_model(model)
    if spec.name not in _PLANS:
        raise ValueError(f"the {spec.name} family has no parallel plan: register one with "
                         "loom.parallel.model_plan.register_plan")
    return _PLANS[spec.name](model)


for _name, _plan in (("llama", dense_plan), ("qwen3", dense_plan), ("moe", moe_plan),
                     ("qwen3-moe", moe_plan), ("deepseek-v3", deepseek_v3_plan),
                     ("transformers", transformers_plan)):
    register_plan(_name, _plan)
