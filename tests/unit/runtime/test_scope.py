"""A run leaves no process-wide state behind: every compiler option (Dynamo, AOTAutograd's
partitioner, inductor), fp32 matmul precision, logger level, `loom` logger handler and
warning filter is back to its value after a run, however the run ended
(`loom.runtime.scope`, `loom.trainer.scoped`). Real runs are checked in test_fit.py, with
`global_state` and `changed` from here."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import pytest
import torch
import torch._functorch.config
import torch._inductor.config

from loom.config import parse_args
from loom.runtime.scope import GlobalSettings, applied
from loom.trainer.scoped import run_settings

TINY = ["--model", "debug", "--n-layers", "2", "--dataset", "random", "--vocab-size", "256",
        "--seq-len", "32", "--batch-size", "2", "--fp32", "--max-steps", "3"]
COMPILED = ["--compile", "--compile-backend", "aot_eager", "--act-mem-budget", "0.5"]
"""aot_eager: the same partitioner (it reads the budget) without inductor's code generation."""


def global_state() -> dict[str, Any]:
    """Every option of the three compiler config modules, every logger's level, the `loom`
    logger's handlers and propagation, and the warning filters."""
    loggers = logging.root.manager.loggerDict
    return {
        "dynamo": torch._dynamo.config.get_config_copy(),
        "functorch": torch._functorch.config.get_config_copy(),
        "inductor": torch._inductor.config.get_config_copy(),
        "levels": {name: lg.level for name, lg in loggers.items()
                   if isinstance(lg, logging.Logger)},
        "loom": (list(logging.getLogger("loom").handlers), logging.getLogger("loom").propagate),
        "warnings": list(warnings.filters),
        "matmul": torch.get_float32_matmul_precision(),
    }


def changed(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What differs; a logger created during the run counts as changed when its level is
    not the default (NOTSET)."""
    out = {}
    for key in ("dynamo", "functorch", "inductor"):
        out.update({f"{key}.{k}": (before[key].get(k), v) for k, v in after[key].items()
                    if before[key].get(k) != v})
    out.update({f"logger {n}": (before["levels"].get(n, logging.NOTSET), level)
                for n, level in after["levels"].items()
                if before["levels"].get(n, logging.NOTSET) != level})
    for key in ("loom", "warnings", "matmul"):
        if before[key] != after[key]:
            out[key] = (before[key], after[key])
    return out


def test_the_run_declares_what_it_sets():
    """What `run_settings` declares for a compiled run; SimpleFSDP's bucketing only for
    inductor on CUDA (not reachable on a CPU-only machine, so declared and checked here)."""
    cfg = parse_args([*TINY, *COMPILED, "--data-parallel", "simple-fsdp",
                      "--compile-backend", "inductor"])
    options = run_settings(cfg, "cuda").compiler
    assert options["torch._dynamo.config.capture_scalar_outputs"] is True
    assert options["torch._functorch.config.activation_memory_budget"] == 0.5
    assert options["torch._inductor.config.bucket_all_gathers_fx"] == "only_fsdp"
    assert "torch._inductor.config.bucket_all_gathers_fx" not in run_settings(cfg, "cpu").compiler
    assert run_settings(parse_args(TINY), "cuda").compiler == {}
    assert run_settings(parse_args(TINY), "cuda").matmul_precision == "high", "TF32 on CUDA"
    assert run_settings(parse_args(TINY), "cpu").matmul_precision is None


def test_applied_restores_every_declared_option_after_a_failure():
    settings = run_settings(parse_args([*TINY, *COMPILED, "--data-parallel", "simple-fsdp",
                                        "--compile-backend", "inductor"]), "cuda")
    settings |= GlobalSettings(log_levels={"loom": logging.CRITICAL})
    before = global_state()
    with pytest.raises(RuntimeError, match="inside"), applied(settings):
        assert torch._inductor.config.bucket_reduce_scatters_fx == "all"
        assert torch._functorch.config.activation_memory_budget == 0.5
        assert logging.getLogger("loom").level == logging.CRITICAL
        assert torch.get_float32_matmul_precision() == "high"
        raise RuntimeError("a step failed inside")
    assert changed(before, global_state()) == {}


def test_an_unknown_config_module_is_refused():
    with pytest.raises(ValueError, match="not an option"):
        GlobalSettings(compiler={"torch.backends.cudnn.benchmark": True})
    assert GlobalSettings() | GlobalSettings(fresh_dynamo=True) == GlobalSettings(
        fresh_dynamo=True)
