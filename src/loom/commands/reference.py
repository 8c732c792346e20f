"""`python -m loom.commands.reference > docs/flags.md`: the flag reference
(`loom.config.reference.render`) with loom's families registered, so their flags are in it."""

from __future__ import annotations

import sys

import loom.families  # noqa: F401  (registers loom's families)
from loom.config.reference import render
from loom.models.registry import families

if __name__ == "__main__":
    assert families(), "importing the registry registers loom's families"
    sys.stdout.write(render())
