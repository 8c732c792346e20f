"""A one-rank gloo process group in this process, for tests of code that calls collectives."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo group on a store only (no sockets), as `loom train` starts for one
    process; a group that already exists is used and left as it was found."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()
