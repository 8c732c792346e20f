"""`loom <command> ...` with the test-only families registered first (tests/families): what a
user's package that registers a family before calling loom does."""

from __future__ import annotations

import sys

import tests.families.gpt2  # noqa: F401  (registers gpt2-test)
from loom.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
