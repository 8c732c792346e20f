"""Start `loom train` / `loom launch` as real processes, signal them, and inspect the result.

Every wait has a hard limit, so a fault that turns into a hang fails the test instead of
stalling the suite.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tests.harness import REPO, Process, start_process

TINY = ["--model", "debug", "--fp32", "--dataset", "random", "--vocab-size", "256",
        "--seq-len", "32", "--batch-size", "1", "--seed", "3", "--log-every", "1"]
LOOM = [sys.executable, "-m", "loom"]
CACHE = Path(tempfile.gettempdir()) / f"loom-fault-tests-{os.getuid()}"
"""A cache (peak FLOP/s) of these tests' own: processes on other branches share ~/.cache."""


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PBS_")) and k not in ("RANK", "WORLD_SIZE",
                                                                 "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1", LOOM_CACHE_DIR=str(CACHE),
               **extra)
    return env


def start(argv: list[str], **env: str) -> Process:
    return start_process(argv, clean_env(**env))


def train(outdir: Path, *flags: str, **env: str) -> Process:
    return start([*LOOM, "train", *TINY, "--outdir", str(outdir), *flags], **env)


def launch(n: int, outdir: Path, *flags: str, **env: str) -> Process:
    return start([*LOOM, "launch", "-n", str(n), *LOOM, "train", *TINY, "--outdir",
                  str(outdir), *flags], **env)


def wait_for(condition: Callable[[], bool], what: str, limit: float,
             proc: Process | None = None) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"exited {proc.returncode} before {what}\n{out[-2000:]}\n"
                                 f"{err[-3000:]}")
        assert time.monotonic() < deadline, f"no {what} within {limit} s"
        time.sleep(0.1)


def steps_logged(outdir: Path, rank: int = 0) -> int:
    path = outdir / f"metrics-{rank}.jsonl"
    return path.read_text().count("\n") if path.is_file() else 0


def finish(proc: Process, limit: float) -> tuple[int, str, str]:
    """Exit code, stdout, stderr; the process is killed (and the test fails) past `limit`."""
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"still running after {limit} s\n{out[-2000:]}\n{err[-3000:]}") \
            from None
    return proc.returncode, out, err


def children(pid: int) -> list[int]:
    """Direct children of `pid` (the ranks of an in-process elastic agent)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def rank_of(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in env if v.startswith(b"RANK=")).split(b"=")[1])


def alive(pid: int) -> bool:
    """Running or stopped; a zombie (exited, not yet reaped by init) counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def digest(folder: Path) -> dict[str, str]:
    """Every file under `folder` (the lock aside) by its sha256."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def error_lines(stderr: str) -> list[str]:
    """The lines a user reads as errors (warnings and progress aside)."""
    return [line for line in stderr.splitlines()
            if line.startswith(("error", "loom:", "loom launch:"))]
