"""`loom plan`: predict a training step's per-rank peak memory and time before launch."""

import loom.families  # noqa: F401  (loom's families register: every command here builds models)
