"""One rank of `loom train` whose storage reports a full disk on rank 1's second save."""

from __future__ import annotations

import errno
import sys
from pathlib import Path

import loom.checkpoint.checkpointer
from loom import cli
from loom.checkpoint.format import TensorWriter


class FullDiskWriter(TensorWriter):
    def write_data(self, plan: object, planner: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))


def storage_writer(path: Path) -> TensorWriter:
    full = "step-2" in str(path) and cli.rank_info().rank == 1
    return FullDiskWriter(path) if full else TensorWriter(path)


if __name__ == "__main__":
    loom.checkpoint.checkpointer.storage_writer = storage_writer
    cli.main(["train", *sys.argv[1:]])
