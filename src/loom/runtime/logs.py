"""Where loom's log lines go, and the upstream noise they leave out. The lowest module
every command (train, plan, eval, doctor) and test worker sets its logging up from."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import TextIO

VIEW_WARNING = r"FSDP2-wrapped module .* returned a view tensor"
"""The one torch warning about loom's own module outputs that needs no action (see
`quiet_known_upstream_noise`); pyproject.toml's pytest filter names it too."""


def setup_logging(rank: int, stream: TextIO | None = None) -> None:
    """Rank 0 logs progress to stdout; other ranks only report errors. Commands whose stdout
    is a result a script reads (`loom plan`, `loom doctor`) pass `sys.stderr`, so a warning
    (a busy machine's peak, say) never lands in front of their output."""
    handler = logging.StreamHandler(stream or (sys.stdout if rank == 0 else sys.stderr))
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("loom")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    logger.propagate = False
    quiet_known_upstream_noise()


UPSTREAM_NOTICE_LOGGERS = ("torch._higher_order_ops.wrap", "torchao", "torch.utils._pytree",
                           "transformers")
"""Loggers of upstream notices about things loom has handled or that need no action, kept
behind `--verbose` in every command: torchao's "Failed to load ....so" lines and torch's
`_pytree` deprecation notes (both printed when transformers imports torchao), transformers'
own warnings, and dynamo's note that SimpleFSDP's gather-recompute checkpoint context_fn
must avoid in-place ops (it has none)."""


def quiet_upstream_notices() -> None:
    """Upstream notices off (errors still show); called before those libraries are imported,
    so their loggers are born quiet."""
    for name in UPSTREAM_NOTICE_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # it resets its level on import


def quiet_known_upstream_noise() -> None:
    """Silence torch messages that fire every step yet need no action from the user."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    # FSDP2 warns when a unit returns a view, because an in-place op on it would skip the
    # unit's pre-backward all-gather. loom's views (DTensor.to_local of the TP embedding and
    # head, the experts' all-to-all result under EP) are only read out of place: the losses
    # modify fp32 copies, the MoE combine and the blocks add; every parity test would fail
    # on a skipped gather. A clone would cost a logits-sized copy per step.
    warnings.filterwarnings("ignore", message=VIEW_WARNING)
    warnings.filterwarnings("ignore", message=r"Slicing a flattened dim from root mesh")
