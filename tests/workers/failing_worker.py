"""`loom train` whose rank 1 raises at step 3, to test that the whole job ends promptly."""

from __future__ import annotations

import sys

from loom.cli import run_train
from loom.runtime.distributed import rank_info
from loom.trainer.trainer import Trainer

original_step = Trainer.train_step


def failing_step(self: Trainer, *args, **kwargs):
    if rank_info().rank == 1 and self.loop.step >= 2:
        raise RuntimeError("rank 1 failed on purpose at step 3")
    return original_step(self, *args, **kwargs)


Trainer.train_step = failing_step

if __name__ == "__main__":
    sys.exit(run_train(sys.argv[1:]))
