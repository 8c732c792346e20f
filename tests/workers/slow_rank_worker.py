"""One rank of `loom train` in which rank SLOW_RANK is slowed inside every step: after the
step's own work it sleeps SLOW_FACTOR times as long as that work took, and at least
SLOW_MIN_S. A sleep costs the same whatever share of the CPU the rank gets, so the slowdown
holds on a loaded machine (a SIGSTOP/SIGCONT duty cycle only takes away CPU time the rank
may not have had), and the factor keeps it when the load slows the rank's work as well."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from loom import cli
from loom.trainer import trainer as train


def slowed(step: Any, factor: float, min_s: float) -> Any:
    def train_step(self: train.Trainer, micro_batches: list) -> Any:
        start = time.perf_counter()
        result = step(self, micro_batches)
        time.sleep(max(min_s, factor * (time.perf_counter() - start)))
        return result

    return train_step


if __name__ == "__main__":
    if cli.rank_info().rank == int(os.environ["SLOW_RANK"]):
        train.Trainer.train_step = slowed(train.Trainer.train_step,
                                          float(os.environ.get("SLOW_FACTOR", "0")),
                                          float(os.environ.get("SLOW_MIN_S", "0")))
    cli.main(["train", *sys.argv[1:]])
