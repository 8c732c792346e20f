"""`loom plan` of several rows in one process (imports paid once), before the check takes
the GPU: each row's predicted step time and peak, and, for a row that asks, the lightest
--ac (none, then op, then block) whose peak fits in 90 % of the device (the caching
allocator's headroom).

    python3 benchmarks/devcheck/plans.py REQUESTS.json RESULTS.jsonl -- PLAN-FLAGS...

REQUESTS: a list of {name, flags, choose_ac, ac}. One line per row is appended to RESULTS
as it is planned, so a plan cut off by its time limit keeps the rows done before it. A plan
that fails records its error line; nothing falls back.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from loom.plan.command import main as plan_main  # noqa: E402

AC_ORDER = ("none", "op", "block")
HEADROOM = 0.9


def plan(flags: list[str]) -> tuple[dict | None, str]:
    """The plan's JSON, or None and its last stderr line."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = plan_main([*flags, "--json"])
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"
    if code != 0:
        lines = err.getvalue().strip().splitlines() or [f"exit {code}"]
        return None, lines[-1]
    return json.loads(out.getvalue().strip().splitlines()[-1]), ""


def plan_row(request: dict, plan_flags: list[str]) -> dict:
    modes = AC_ORDER if request["choose_ac"] else (request["ac"],)
    tried = []
    for ac in modes:
        result, error = plan([*request["flags"], "--ac", ac, *plan_flags])
        if result is None:
            return {"row": request["name"], "ok": False, "error": error, "tried": tried}
        tried.append({"ac": ac, "peak_gib": result["peak_gib"]})
        if result["peak_gib"] <= HEADROOM * result["device_memory_gib"] or ac == modes[-1]:
            fits = result["peak_gib"] <= HEADROOM * result["device_memory_gib"]
            return {"row": request["name"], "ok": fits, "ac": ac,
                    "error": "" if fits else f"no --ac fits: {tried}",
                    "plan_step_s": result["step_time_s"], "plan_peak_gib": result["peak_gib"],
                    "device_memory_gib": result["device_memory_gib"], "tried": tried}
    raise AssertionError("unreachable")


def main(argv: list[str]) -> int:
    requests = json.loads(Path(argv[0]).read_text())
    results = Path(argv[1])
    plan_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    for request in requests:
        line = json.dumps(plan_row(request, plan_flags)) + "\n"
        with open(results, "a") as f:
            f.write(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
