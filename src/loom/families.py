"""Every model family loom ships, registered once, one line each: its spec (model, arguments,
flags, presets, layouts, Hugging Face adapters) with its parallel plan, both from the family's
folder `loom/models/<family>/`. The plan (`plan.py`, the one module of a family that may
reach `torch.distributed` and `loom.parallel`) sits above the parallel package, and so does
this module: the entry points that build or describe models import it (the CLI, `loom.fit`
through `loom.trainer`, `loom plan`, the Hugging Face commands).

A new family: its folder, and one `register(...)` line below.
"""

from __future__ import annotations

from loom.models.deepseek_v3.plan import deepseek_v3_plan
from loom.models.deepseek_v3.spec import DEEPSEEK_V3
from loom.models.llama.plan import dense_plan
from loom.models.llama.spec import LLAMA
from loom.models.moe.plan import moe_plan
from loom.models.moe.spec import MOE
from loom.models.qwen3.spec import QWEN3, QWEN3_MOE
from loom.models.registry import register
from loom.models.transformers.plan import transformers_plan
from loom.models.transformers.spec import TRANSFORMERS

register(LLAMA, plan=dense_plan)
register(QWEN3, plan=dense_plan)
register(MOE, plan=moe_plan)
register(QWEN3_MOE, plan=moe_plan)
register(DEEPSEEK_V3, plan=deepseek_v3_plan)
register(TRANSFORMERS, plan=transformers_plan)
