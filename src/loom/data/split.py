"""The held-out tail of a token stream for `--val-fraction`, cut between documents."""

from __future__ import annotations

import logging

import numpy as np

from loom.data.text import TokenStream

logger = logging.getLogger("loom")

SEARCH_BLOCK = 1 << 20
"""Tokens read at a time while looking for the next end-of-text."""


def held_out_cut(stream: TokenStream, eot_id: int, fraction: float) -> int:
    """The first token of the validation tail: just after the first end-of-text at or past
    (1 - fraction) of the stream, so no document is in both parts. Only the tokens between
    that point and the end-of-text are read. A stream whose last document is longer than
    the tail (the embedded corpus has two) is cut inside that document, with a warning."""
    n = len(stream)
    target = min(n - 1, int(n * (1.0 - fraction)))
    position = target
    while position < n - 1:
        block = np.asarray(stream[position:min(position + SEARCH_BLOCK, n - 1)])
        hits = np.flatnonzero(block == eot_id)
        if hits.size:
            return position + int(hits[0]) + 1
        position += block.size
    logger.warning("--val-fraction %g: the last document is longer than the held-out tail; "
                   "cutting inside it (its first part trains, the rest validates)", fraction)
    return target
