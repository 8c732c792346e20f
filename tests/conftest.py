"""Test-session defaults shared by every test and every rank a test spawns."""

import os
from pathlib import Path

# Inductor's compiled kernels persist across sessions: a warm cache turns a 25-40 s cold
# compile into ~3 s. Spawned ranks inherit the variable; CI sets the same folder.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "loom-inductor"))
