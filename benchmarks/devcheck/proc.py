"""The device check's children: one fresh process per run (its own compile caches, device
memory and failure), a wall-clock limit that kills its whole process tree, and death with
the check (a killed check leaves no run holding the GPU)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGKILL when the check's process dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class Child:
    rc: int | None
    """None: killed at its time limit."""
    stdout: str
    stderr_tail: list[str]
    seconds: float

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def why(self) -> str:
        """One line: what went wrong, for the row's status."""
        if self.rc is None:
            return f"timed out after {self.seconds:.0f} s"
        lines = [line for line in self.stderr_tail if line.strip()]
        errors = [line for line in lines if "error" in line.lower()]
        last = (errors or lines or ["(no output)"])[-1].strip()
        return f"exit {self.rc}: {last[:300]}"

    def last_json(self) -> dict | None:
        for line in reversed(self.stdout.splitlines()):
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    return None
        return None


def child_env(site: str | None, threads: int | None) -> dict[str, str]:
    """loom from this checkout's src/ (it is not installed on the GPU machine) and the
    carried wheels' folder, ahead of anything else on the path."""
    paths = [str(REPO / "src"), *([site] if site else []),
             *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run(argv: list[str], timeout_s: float, log: Path, env: dict[str, str]) -> Child:
    """Run `python3 argv...`, stdout and stderr to `log`.out/.err; kill it at `timeout_s`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    out_path, err_path = log.with_suffix(".out"), log.with_suffix(".err")
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, *argv], stdout=out, stderr=err, env=env,
                                cwd=REPO, start_new_session=True,
                                preexec_fn=_die_with_parent)
        try:
            rc: int | None = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    seconds = time.perf_counter() - start
    tail = err_path.read_text(errors="replace").splitlines()[-40:]
    return Child(rc, out_path.read_text(errors="replace"), tail, seconds)
