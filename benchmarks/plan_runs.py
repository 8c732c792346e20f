"""`loom plan` of several runs in one process (imports paid once), for device_check.sh.

    python benchmarks/plan_runs.py RUNS [--choose-ac] -- PLAN-FLAGS... < requests

Each request line is a run's name, a tab and its `loom train` flags (space-separated); the
plan is written to RUNS/NAME.plan.json. With --choose-ac the run is planned with --ac none,
op, then block, stopping at the first that fits in 90% of the device (the caching
allocator's headroom), which is written to RUNS/NAME.ac. A failed plan writes its error
line to RUNS/NAME.plan.err and the rest go on.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

from loom.plan.command import main as plan_main

AC_ORDER = ("none", "op", "block")
HEADROOM = 0.9


def plan(flags: list[str]) -> dict | None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = plan_main([*flags, "--json"])
    if code != 0:
        print(err.getvalue().strip().splitlines()[-1:], file=sys.stderr)
        return None
    return json.loads(out.getvalue().strip().splitlines()[-1])


def main() -> int:
    args = sys.argv[1:]
    runs, choose = Path(args[0]), "--choose-ac" in args
    plan_flags = args[args.index("--") + 1:] if "--" in args else []
    for line in sys.stdin.read().splitlines():
        if not line.strip():
            continue
        name, _, flags = line.partition("\t")
        train = flags.split()
        modes = AC_ORDER if choose else (None,)
        result, chosen = None, modes[-1]
        for ac in modes:
            result = plan([*train, *(["--ac", ac] if ac else []), *plan_flags])
            if result is not None and result["peak_gib"] <= HEADROOM * result["device_memory_gib"]:
                chosen = ac
                break
        if result is None:
            (runs / f"{name}.plan.err").write_text("plan failed\n")
            continue
        (runs / f"{name}.plan.json").write_text(json.dumps(result) + "\n")
        if choose:
            (runs / f"{name}.ac").write_text(f"{chosen}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
