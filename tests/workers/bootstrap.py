"""The start and end every rank of a test or benchmark job shares: read the rank from the
launcher's environment, log as loom does, join the process group, and always leave it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from loom.runtime.distributed import RankInfo, init_distributed, rank_info, teardown
from loom.runtime.logs import setup_logging


@contextmanager
def rank_job() -> Iterator[tuple[RankInfo, torch.device]]:
    info = rank_info()
    setup_logging(info.rank)
    device = init_distributed(info)
    try:
        yield info, device
    finally:
        teardown()
