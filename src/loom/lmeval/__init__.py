"""Benchmark tasks through lm-evaluation-harness, an optional extra (`pip install
'loom[eval]'`): `model` wraps loom's model as the harness's `LM`, `harness` finds and runs
tasks. Both import `lm_eval`; callers check `require_lm_eval` first and import them by name,
so loom runs without the extra until tasks are asked for."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from loom.config import ConfigError


def require_lm_eval(flag: str) -> ModuleType:
    """`loom.lmeval.harness`, or one line saying how to install what it needs."""
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(f"{flag} needs lm-evaluation-harness, which is not installed: "
                          "pip install 'loom[eval]' (or lm_eval>=0.4)")
    return importlib.import_module("loom.lmeval.harness")
