"""Every model family loom ships, registered once, one line each: its spec (model, arguments,
flags, Hugging Face adapters, from `loom/models/<family>/`) with its parallel plan (from
`loom/parallel/<family>_plan.py`). This module sits above both, so models never import the
parallel code; `loom.parallel` imports it, so every run that parallelizes has the families.

A new family: its folder, its plan, and one `register(...)` line below.
"""

from __future__ import annotations

from loom.models.deepseek_v3.spec import DEEPSEEK_V3
from loom.models.llama.spec import LLAMA
from loom.models.moe.spec import MOE
from loom.models.qwen3.spec import QWEN3, QWEN3_MOE
from loom.models.registry import register
from loom.models.transformers.spec import TRANSFORMERS
from loom.parallel.deepseek_v3_plan import deepseek_v3_plan
from loom.parallel.llama_plan import dense_plan
from loom.parallel.moe_plan import moe_plan
from loom.parallel.transformers_plan import transformers_plan

register(LLAMA, plan=dense_plan)
register(QWEN3, plan=dense_plan)
register(MOE, plan=moe_plan)
register(QWEN3_MOE, plan=moe_plan)
register(DEEPSEEK_V3, plan=deepseek_v3_plan)
register(TRANSFORMERS, plan=transformers_plan)
