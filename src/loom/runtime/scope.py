"""Process-wide settings a run changes, applied for that run only.

Compiler options (Dynamo, AOTAutograd's partitioner, inductor), fp32 matmul precision,
logger levels and warning filters are module globals of torch and of `logging`: set once and
left, they leak into the next run of the same process (a notebook's second `loom.fit`, `loom
verify`'s next layout, a test after a test). A run declares what it needs as one
`GlobalSettings` and enters `applied(...)` around everything it does, so they are restored
after it, failure included. Compiled graphs are built lazily, at the first step, and read
these options then: the scope covers the whole run, not only the `torch.compile` calls.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

COMPILER_CONFIGS = ("torch._dynamo.config", "torch._functorch.config", "torch._inductor.config")
"""The config modules a `GlobalSettings.compiler` key may name (each has `.patch`)."""


def _frozen(values: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    return MappingProxyType(dict(values or {}))


@dataclass(frozen=True)
class GlobalSettings:
    """What one run sets process-wide, declared rather than done: entered by `applied`."""

    compiler: Mapping[str, Any] = field(default_factory=_frozen)
    """Full option name -> value, e.g. "torch._dynamo.config.capture_scalar_outputs": True."""
    log_levels: Mapping[str, int] = field(default_factory=_frozen)
    """Logger name -> level."""
    ignored_warnings: tuple[str, ...] = ()
    """Message regexes of warnings that need no action from the user."""
    fresh_dynamo: bool = False
    """Drop Dynamo's caches on entry and exit (a run that compiles): code compiled under
    another run's options, or for another model with the same code objects, would otherwise
    be reused, or count towards the recompile limit past which Dynamo silently runs eager."""
    matmul_precision: str | None = None
    """`torch.set_float32_matmul_precision` for the run ("high": TF32 for fp32 matmuls on
    CUDA); None leaves it as it is."""

    def __post_init__(self) -> None:
        unknown = [k for k in self.compiler if k.rpartition(".")[0] not in COMPILER_CONFIGS]
        if unknown:
            raise ValueError(f"not an option of {', '.join(COMPILER_CONFIGS)}: {unknown}")

    def __or__(self, other: GlobalSettings) -> GlobalSettings:
        """Both runs' settings; `other` wins where both set one."""
        return GlobalSettings(_frozen({**self.compiler, **other.compiler}),
                              _frozen({**self.log_levels, **other.log_levels}),
                              tuple(dict.fromkeys(self.ignored_warnings + other.ignored_warnings)),
                              self.fresh_dynamo or other.fresh_dynamo,
                              other.matmul_precision or self.matmul_precision)


@contextlib.contextmanager
def logger_levels(levels: Mapping[str, int]) -> Iterator[None]:
    """Each named logger at its level inside, at the level it had before outside."""
    loggers = {name: logging.getLogger(name) for name in levels}
    before = {name: lg.level for name, lg in loggers.items()}
    try:
        for name, lg in loggers.items():
            lg.setLevel(levels[name])
        yield
    finally:
        for name, lg in loggers.items():
            lg.setLevel(before[name])


def _compiler_patches(options: Mapping[str, Any]) -> list[contextlib.AbstractContextManager]:
    """One `config.patch(...)` per config module named in `options`."""
    by_module: dict[str, dict[str, Any]] = {}
    for name, value in options.items():
        module, _, option = name.rpartition(".")
        by_module.setdefault(module, {})[option] = value
    return [importlib.import_module(m).patch(**values) for m, values in by_module.items()]


@contextlib.contextmanager
def applied(settings: GlobalSettings) -> Iterator[None]:
    """The settings in force inside; every one back to its previous value after, however
    the block ends."""
    with contextlib.ExitStack() as stack:
        if settings.fresh_dynamo:
            # By name, as the config modules are: this module (and `loom.runtime.logs`,
            # which builds on it) stays importable without torch.
            dynamo = importlib.import_module("torch._dynamo")
            dynamo.reset()
            stack.callback(dynamo.reset)
        if settings.matmul_precision is not None:
            torch = importlib.import_module("torch")
            stack.callback(torch.set_float32_matmul_precision,
                           torch.get_float32_matmul_precision())
            torch.set_float32_matmul_precision(settings.matmul_precision)
        for patch in _compiler_patches(settings.compiler):
            stack.enter_context(patch)
        stack.enter_context(logger_levels(settings.log_levels))
        stack.enter_context(warnings.catch_warnings())  # restores the filter list on exit
        for message in settings.ignored_warnings:
            warnings.filterwarnings("ignore", message=message)
        yield
