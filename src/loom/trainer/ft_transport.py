"""How a recovering replica group receives a healthy group's state: torchft's HTTP transport,
read as loom reads any checkpoint.

torchft 0.2.0's own receive unpickles whatever the peer's server sends with torch's full
unpickler (`weights_only=False`): anything on the network that answers the address the
lighthouse hands out could run code in the recovering ranks. Here the state is read with
torch's weights-only unpickler (tensors, numbers, strings and plain containers: all that
loom's and DiLoCo's state holds) and no more bytes than `limit()`, which the caller sizes
from its own state (the peer's has the same shapes): a record longer than that is refused
before it is read.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from datetime import timedelta
from typing import Any


class TooLarge(ValueError):
    """The peer sent more than a state of this rank's size could take."""


class Capped:
    """A response read through a budget of bytes: a read beyond it raises before it is
    attempted, so a hostile length cannot make the reader allocate it."""

    def __init__(self, stream: Any, limit: int):
        self.stream, self.left = stream, limit

    def take(self, n: int) -> None:
        if n < 0 or n > self.left:
            raise TooLarge(f"the peer's state is larger than this rank's could be "
                           f"({self.left:,} bytes left of the limit)")
        self.left -= n

    def read(self, n: int = -1) -> bytes:
        self.take(n if n >= 0 else self.left + 1)  # an unbounded read is refused
        return self.stream.read(n)

    def readline(self, n: int = -1) -> bytes:
        line = self.stream.readline(self.left + 1 if n < 0 else min(n, self.left + 1))
        self.take(len(line))
        return line


def checked_transport(timeout: timedelta, limit: Callable[[], int]) -> Any:
    """torchft's HTTP checkpoint transport (its server unchanged) with a checked receive;
    torchft is imported here, only under --ft-replica-groups."""
    from torchft.checkpointing.http_transport import HTTPTransport  # the optional `ft` extra

    class CheckedTransport(HTTPTransport):
        def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                            timeout: timedelta) -> Any:
            # private torch API (torch.distributed._serialization, torch 2.7+, checked on
            # 2.13): the streaming format torchft's server writes
            from torch.distributed._serialization import _streaming_load

            url = f"{metadata}{step}/full"
            with urllib.request.urlopen(url, timeout=timeout.total_seconds()) as response:
                return _streaming_load(Capped(response, limit()), weights_only=True)

    return CheckedTransport(timeout=timeout, num_chunks=0)
