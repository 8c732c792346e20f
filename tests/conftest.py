"""Test-session defaults shared by every test and every rank a test spawns."""

import logging
import os
from pathlib import Path

import pytest

import loom.families  # noqa: F401  (loom's families register, flags too, first)
from tests.one_rank import one_rank_group

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
    """A one-rank gloo group for one test (`tests.one_rank`)."""
    with one_rank_group():
        yield
