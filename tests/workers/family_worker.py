"""The parity worker with the test-only families registered first (tests/families)."""

from __future__ import annotations

import json
import sys

import tests.families.gpt2  # noqa: F401  (registers gpt2-test)
from tests.workers.parity_worker import main

if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2:])
