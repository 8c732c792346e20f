"""Test-session defaults shared by every test and every rank a test spawns."""

import logging
import os
from pathlib import Path

import pytest
import torch.distributed as dist

# Inductor's compiled kernels persist across sessions: a warm cache turns a 25-40 s cold
# compile into ~3 s. Spawned ranks inherit the variable; CI sets the same folder.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "loom-inductor"))


@pytest.fixture
def loom_logger_restored():
    """An in-process command sets the "loom" logger up for the whole process (no
    propagation, so caplog would miss it); later tests in the session need it back."""
    logger = logging.getLogger("loom")
    saved = logger.handlers[:], logger.level, logger.propagate
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


@pytest.fixture
def process_group():
    """A one-rank gloo group (a store only), as `loom train` starts for one process; left
    as it was found when a group already exists."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()
