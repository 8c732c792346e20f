"""`--dataset PATH:W,PATH:W,...`: a weighted mixture's sources and exact weights, parsed
without heavy imports (the flags are checked before torch loads); the schedule that deals
its windows is `loom.data.mixture`."""

from __future__ import annotations

import math
import os
import re
from fractions import Fraction

from loom.errors import ConfigError

MAX_CYCLE = 10_000
"""Longest schedule cycle (the weights' common denominator): 0.3333/0.6667 is 10,000. A
renormalised cycle (`drop`) is never longer: its denominators divide the remaining share's."""
WEIGHT = re.compile(r"[0-9]{1,9}(\.[0-9]{1,9})?|\.[0-9]{1,9}|[0-9]{1,9}/[0-9]{1,9}")
"""A weight as written: a decimal (0.3, 3) or a ratio (1/3) in ASCII digits (a Unicode digit
class would take ٣ too); no exponent, whose exact value could be a number of a billion digits."""
MAX_SOURCES = 16
"""Most sources in one mixture (a crafted list of thousands would only cost time)."""


def parse_mixture(spec: str | None) -> list[tuple[str, Fraction]] | None:
    """[(source, weight), ...] normalised to sum 1 when `spec` is `PATH:W,PATH:W,...` (two
    or more sources, each weight a positive number after its last `:`); None when it is
    one dataset. A source given twice or a bad weight is a ConfigError."""
    if spec is None or "," not in spec:
        return None
    parts = [p.strip().rpartition(":") for p in spec.split(",")]
    if not all(sep and path for path, sep, _ in parts):
        return None  # a path with a comma in it, not a mixture
    if len(parts) > MAX_SOURCES:
        raise ConfigError(f"--dataset: a mixture of {len(parts)} sources; at most "
                          f"{MAX_SOURCES}")
    sources: list[tuple[str, Fraction]] = []
    for path, _, weight in parts:
        try:
            if not WEIGHT.fullmatch(weight):
                raise ValueError(weight)
            w = Fraction(weight)
        except (ValueError, ZeroDivisionError):
            raise ConfigError(f"--dataset {spec}: weight {weight!r} of {path} is not a "
                              "number (a decimal like 0.3 or a ratio like 1/3)") from None
        if w <= 0:
            raise ConfigError(f"--dataset {spec}: weight {weight} of {path} must be > 0")
        sources.append((path, w))
    named: dict[str, str] = {}
    for path, _ in sources:  # a.txt and ./a.txt, or a link to it, are one file
        real = os.path.realpath(os.path.expanduser(path))
        if real in named:
            raise ConfigError(f"--dataset {spec}: a source is named twice ({named[real]} "
                              f"and {path} are one file); name it once with the sum of its "
                              "weights")
        named[real] = path
    total = sum(w for _, w in sources)
    normalised = [(p, w / total) for p, w in sources]
    if math.lcm(*(w.denominator for _, w in normalised)) > MAX_CYCLE:
        raise ConfigError(f"--dataset {spec}: the weights' common denominator exceeds "
                          f"{MAX_CYCLE:,}; give them with fewer digits")
    return normalised
