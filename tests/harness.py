"""Spawn N local gloo ranks as plain processes, with a hard timeout, and collect results.

Every multi-rank test goes through `run_ranks`, so no test can hang CI: on timeout every
rank is killed and the test fails with what the ranks printed. Each rank writes its stdout
and stderr to files (`LoggedOutput`), read after the job ends: a chatty rank cannot fill a
pipe and block while another rank is waited on. Ranks are forked from a zygote that has
torch and loom imported where their environment allows (`tests/zygote.py`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.zygote import LoggedOutput, ZygoteProcess

REPO = Path(__file__).resolve().parents[1]


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str


@dataclass
class JobResult:
    ranks: list[RankResult]

    @property
    def ok(self) -> bool:
        return all(r.returncode == 0 for r in self.ranks)

    def describe(self) -> str:
        return "\n".join(f"--- rank {r.rank} exit {r.returncode}\n{r.stdout[-3000:]}\n"
                         f"{r.stderr[-3000:]}" for r in self.ranks)


class LoggedProcess(LoggedOutput, subprocess.Popen):
    """A fresh process whose stdout and stderr go to files (`LoggedOutput`)."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path | None = REPO):
        self.logs = Path(tempfile.mkdtemp(prefix="loom-proc-"))
        with open(self.logs / "out", "w") as out, open(self.logs / "err", "w") as err:
            super().__init__(argv, cwd=cwd, env=env, stdout=out, stderr=err, text=True)


Process = LoggedProcess | ZygoteProcess
"""A started test process: both kinds wait, poll, signal and `communicate` alike."""


def start_process(argv: list[str], env: dict[str, str], cwd: Path | None = REPO) -> Process:
    """`argv`, its output to files: a Python command is forked from the zygote of its
    environment where there is one (`tests/zygote.py`: torch and loom already imported),
    anything else starts fresh."""
    return ZygoteProcess.start(argv, env, cwd) or LoggedProcess(argv, env, cwd)


def run_process(argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = REPO,
                timeout: float = 300.0) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, capture_output=True, text=True)` through `start_process`: killed
    past `timeout` (a hang limit), which then raises TimeoutExpired as `subprocess.run` does."""
    proc = start_process(argv, dict(os.environ) if env is None else env, cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
    env.update(extra or {})
    return env


def run_ranks(nproc: int, argv: list[str], timeout: float = 300.0,
              env: dict[str, str] | None = None, cwd: Path | None = None) -> JobResult:
    """Run `python <argv>` as ranks 0..nproc-1; kill them all if the job outlives `timeout`
    (a hang limit, not a speed check: keep it >= 5x the idle time)."""
    port = free_port()
    procs = [start_process([sys.executable, *argv], rank_env(r, nproc, port, env), cwd)
             for r in range(nproc)]
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
        for proc in procs:
            proc.kill()
    texts = [proc.communicate() for proc in procs]
    if timed_out:
        dump = "\n".join(f"--- rank {i}\n{o[-2000:]}\n{e[-2000:]}" for i, (o, e) in
                         enumerate(texts))
        raise TimeoutError(f"{nproc}-rank job {argv} exceeded {timeout}s\n{dump}")
    return JobResult([RankResult(r, p.returncode, o, e)
                      for r, (p, (o, e)) in enumerate(zip(procs, texts, strict=True))])
