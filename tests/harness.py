"""Spawn N local gloo ranks as plain processes, with a hard timeout, and collect results.

Every multi-rank test goes through `run_ranks`, so no test can hang CI: on timeout every
rank is killed and the test fails with what the ranks printed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

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
    elapsed: float

    @property
    def ok(self) -> bool:
        return all(r.returncode == 0 for r in self.ranks)

    def describe(self) -> str:
        return "\n".join(f"--- rank {r.rank} exit {r.returncode}\n{r.stdout[-3000:]}\n"
                         f"{r.stderr[-3000:]}" for r in self.ranks)


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


def run_ranks(nproc: int, argv: list[str], timeout: float = 240.0,
              env: dict[str, str] | None = None, cwd: Path | None = None) -> JobResult:
    """Run `python <argv>` as ranks 0..nproc-1; kill them all if the job outlives `timeout`."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, *argv], env=rank_env(r, nproc, port, env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=cwd)
             for r in range(nproc)]
    start = time.monotonic()
    outputs: list[tuple[str, str]] = []
    try:
        for proc in procs:
            remaining = max(1.0, timeout - (time.monotonic() - start))
            outputs.append(proc.communicate(timeout=remaining))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        texts = [p.communicate() for p in procs]
        dump = "\n".join(f"--- rank {i}\n{o[-2000:]}\n{e[-2000:]}" for i, (o, e) in
                         enumerate(texts))
        raise TimeoutError(f"{nproc}-rank job {argv} exceeded {timeout}s\n{dump}") from None
    return JobResult([RankResult(r, p.returncode, o, e)
                      for r, (p, (o, e)) in enumerate(zip(procs, outputs, strict=True))],
                     time.monotonic() - start)
