"""Where loom's log lines go, and the upstream noise they leave out. The lowest module
every command (train, plan, eval, doctor) and test worker sets its logging up from.

A command or `loom.fit` scopes both (`log_output`, and `log_settings` entered through
`loom.runtime.scope.applied`): a process that runs several of them, a notebook or a test
session, gets its own logging back after each. `setup_logging` is for a script that is the
whole process (a test worker)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from typing import TextIO

from loom.runtime.scope import GlobalSettings, applied

VIEW_WARNING = r"FSDP2-wrapped module .* returned a view tensor"
"""The one torch warning about loom's own module outputs that needs no action (see
`IGNORED_WARNINGS`); pyproject.toml's pytest filter names it too."""

UPSTREAM_NOTICE_LOGGERS = ("torch._higher_order_ops.wrap", "torchao", "torch.utils._pytree",
                           "transformers")
"""Loggers of upstream notices about things loom has handled or that need no action, kept
behind `--verbose` in every command: torchao's "Failed to load ....so" lines and torch's
`_pytree` deprecation notes (both printed when transformers imports torchao), transformers'
own warnings, and dynamo's note that SimpleFSDP's gather-recompute checkpoint context_fn
must avoid in-place ops (it has none)."""
NOISE_LOGGERS = ("torch.distributed.tensor._redistribute",)
"""torch loggers whose messages fire every step yet need no action from the user."""
IGNORED_WARNINGS = (VIEW_WARNING, r"Slicing a flattened dim from root mesh")
"""FSDP2 warns when a unit returns a view, because an in-place op on it would skip the
unit's pre-backward all-gather. loom's views (DTensor.to_local of the TP embedding and head,
the experts' all-to-all result under EP) are only read out of place: the losses modify fp32
copies, the MoE combine and the blocks add; every parity test would fail on a skipped
gather. A clone would cost a logits-sized copy per step. The mesh-slicing note is DeviceMesh
describing its own internals."""


def _handler(rank: int, stream: TextIO | None) -> logging.Handler:
    handler = logging.StreamHandler(stream or (sys.stdout if rank == 0 else sys.stderr))
    handler.setFormatter(logging.Formatter("%(message)s"))
    return handler


def setup_logging(rank: int, stream: TextIO | None = None) -> None:
    """`log_output` and the known noise silenced for the rest of the process."""
    logger = logging.getLogger("loom")
    logger.addHandler(_handler(rank, stream))
    logger.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    logger.propagate = False
    quiet_known_upstream_noise()


@contextlib.contextmanager
def log_output(rank: int, stream: TextIO | None = None) -> Iterator[None]:
    """Inside: rank 0 logs progress to stdout, other ranks only report errors. Commands
    whose stdout is a result a script reads (`loom plan`, `loom doctor`) pass `sys.stderr`,
    so a warning (a busy machine's peak, say) never lands in front of their output. After:
    the `loom` logger as it was (handlers, level, propagation)."""
    logger = logging.getLogger("loom")
    handler, level, propagate = _handler(rank, stream), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def log_settings(verbose: bool) -> GlobalSettings:
    """What a run silences: the known per-step noise always, upstream notices unless
    --verbose (`quiet_known_upstream_noise`, `quiet_upstream_notices` say why)."""
    levels = {name: logging.ERROR for name in (*NOISE_LOGGERS, *(
        () if verbose else UPSTREAM_NOTICE_LOGGERS))}
    return GlobalSettings(log_levels=levels, ignored_warnings=IGNORED_WARNINGS)


@contextlib.contextmanager
def logging_scope(rank: int, stream: TextIO | None = None, verbose: bool = True
                  ) -> Iterator[None]:
    """A command's logging for its duration: `log_output` and `log_settings`."""
    with log_output(rank, stream), applied(log_settings(verbose)):
        yield


def quiet_upstream_notices() -> None:
    """Upstream notices off (errors still show); called before those libraries are imported,
    so their loggers are born quiet."""
    for name in UPSTREAM_NOTICE_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # it resets its level on import


def quiet_known_upstream_noise() -> None:
    """Silence, for the rest of the process, torch messages that fire every step yet need
    no action from the user."""
    for name in NOISE_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for message in IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
