"""The training loop: the trainer, one step and its executors, evaluation, the optimizer,
extension points."""

import loom.families  # noqa: F401  (loom's families register: every command here builds models)
