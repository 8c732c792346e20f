"""`flag()`: how the schema declares a field that is also a command-line flag, and the range
of every number a user can set.

Kept apart from `loom.config.schema`, which holds only the declarations, so the schema stays
one list of flags. The ranges are checked, for flags, environment, a --config file and a
`JobConfig` built in Python alike, by `loom.config.numbers`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import field
from typing import Any

INT64_MAX = 2**63 - 1
"""The widest integer any setting may hold: what torch's seeds and sizes take."""
SIZE_MAX = 2**24
"""Widths, vocabularies and sequence lengths: 16M is past every model's, and keeps products
of them (a layer's elements) far inside int64 before the memory check sizes the model."""
COUNT_MAX = 2**16
"""Layers, heads, experts and parallel degrees."""
VAL_SETS_MAX = 32
"""--val-dataset sets: each holds its tokens memory-mapped (an open file) for the run, so 300
ran out of a 256-descriptor limit half-way through start-up."""
FOREVER_S = 365 * 86400.0
"""Time limits in seconds: a year is past any run, and inside every timer's range."""


def flag(default: Any, help: str, *, aliases: Sequence[str] = (), type: Callable | None = None,
         choices: Sequence[str] | None = None, hidden: bool = False,
         const: Any = None, env: str | None = None, repeat: bool = False,
         most: int | None = None, ge: float | None = 0, gt: float | None = None,
         le: float | None = None, lt: float | None = None, finite: bool = True) -> Any:
    """Declare a dataclass field that is also a command-line flag (and, with `env`, an
    environment variable read by `loom.config.sources`). `repeat`: the flag may be given
    several times, at most `most` (each value may open files: a count is bounded as a
    number is); the field is the tuple of its values (`type` each), in order.

    A number's range: `ge`/`gt` its lower bound (inclusive/exclusive; `gt` replaces `ge`,
    and `ge=None` with no `gt` leaves it unbounded below), `le`/`lt` its upper one. Numbers
    are >= 0 unless declared otherwise, integers fit int64, floats are finite unless
    `finite=False` (nan never passes), so a new flag is checked without a word more."""
    meta = dict(help=help, aliases=tuple(aliases), type=type, choices=choices,
                hidden=hidden, const=const, env=env, repeat=repeat, most=most,
                bounds=bounds(ge=ge, gt=gt, le=le, lt=lt, finite=finite))
    return field(default=default, metadata=meta)


def bounds(*, ge: float | None = 0, gt: float | None = None, le: float | None = None,
           lt: float | None = None, finite: bool = True) -> tuple:
    """A number's range as `flag()` declares it, for a number that is no flag of its own (a
    Hub folder's config.json field, one of a flag's values): `loom.config.numbers.
    check_number` holds a value to it with the same one-line error a flag gets."""
    return (None if gt is not None else ge, gt, le, lt, finite)


SIZE = dict(ge=1, le=SIZE_MAX)
"""A width, vocabulary or length: at least 1."""
DEGREE = dict(ge=1, le=COUNT_MAX)
"""A parallel degree or a count of layers or heads: at least 1."""
