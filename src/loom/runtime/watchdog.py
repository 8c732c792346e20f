"""Threads that end a rank which can no longer finish: its launcher died, or the job stalled.

Both end the process with `os._exit`: the main thread may be blocked inside a collective
that Python cannot interrupt, and a rank that waits for it would outlive the job.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported lazily: the launcher watch starts before torch is imported
    import torch.distributed as dist

LAUNCHER_PID_ENV = "LOOM_LAUNCHER_PID"
"""Set by `loom launch` for its workers: the pid they must not outlive."""
LAUNCH_ATTEMPT_ENV = "LOOM_LAUNCH_ATTEMPT"
"""Set by `loom launch --retries` for its workers: 0, then 1, 2, ... on each retry. A new
srun in the same job does not raise SLURM_RESTART_COUNT, so without it a retry would not
know to resume the run folder."""

FAILURE_EXIT = 1


def _daemon(target: object, name: str) -> None:
    threading.Thread(target=target, name=name, daemon=True).start()


HANG_KEY = "loom_hang"
"""The error file's entry with a hang's facts, which `loom launch` joins across ranks into
one line (torch's agent reads only `message` and `timestamp`)."""


def report(line: str, hang: dict | None = None) -> None:
    """One line on stderr and, under torch's agent, in the error file the launcher reads."""
    print(line, file=sys.stderr, flush=True)
    write_error_file(line, hang)


def write_error_file(line: str, hang: dict | None = None) -> None:
    """torch's elastic agent reads `message` from this JSON file when the rank fails."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data: dict = {"message": line, "timestamp": int(time.time())}
    if hang is not None:
        data[HANG_KEY] = hang
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps(data))


def watch_launcher(environ: Mapping[str, str] | None = None, period_s: float = 1.0) -> None:
    """Exit when `loom launch` is gone: the agent starts workers in their own sessions, so
    nothing else stops them when the launcher is SIGKILLed. Polling the parent pid works
    on every POSIX system; a dead parent re-parents us to init or a subreaper."""
    env = os.environ if environ is None else environ
    pid = env.get(LAUNCHER_PID_ENV, "")
    if not pid.isdigit() or os.getppid() != int(pid):
        return

    def poll() -> None:
        while os.getppid() == int(pid):
            time.sleep(period_s)
        try:  # stderr may be a pipe nobody reads any more
            report(f"loom: launcher (pid {pid}) is gone; rank {env.get('RANK', '?')} stops")
        finally:
            os._exit(FAILURE_EXIT)

    _daemon(poll, "loom-launcher-watch")


def heartbeat_period(timeout_s: float) -> float:
    return min(5.0, max(0.5, timeout_s / 10))


def collective_timeout_s(timeout_s: float) -> float:
    """The process group's timeout: a little past the watchdog's, so that a stalled peer
    is reported by the watchdog, which can name it, rather than by gloo, which cannot."""
    return timeout_s + 3 * heartbeat_period(timeout_s)


class StepWatchdog:
    """Ends the rank when no step finishes for `timeout_s`, naming the rank that stopped.

    Each rank refreshes a heartbeat (its last finished step and the time) in the job's
    store from this thread; a SIGSTOPped or dead rank stops refreshing, so on timeout the
    stale heartbeats tell which rank stalled (and on which host). Stacks go to
    `<outdir>/hang-<rank>.txt`; `waiting_in(outdir, rank)`, when given, names the collective
    this rank is stuck in. The error file gets the same facts as data (`HANG_KEY`), so that
    `loom launch` can say which ranks never arrived and which waited.
    """

    def __init__(self, timeout_s: float, outdir: Path, rank: int, world_size: int,
                 store: dist.Store | None,
                 waiting_in: Callable[[Path, int], str | None] | None = None):
        self.timeout_s, self.outdir, self.rank, self.world = timeout_s, outdir, rank, world_size
        self.store, self.waiting_in = store, waiting_in
        self.period_s = heartbeat_period(timeout_s)
        self.step, self.last_progress = 0, time.monotonic()
        self.stopped = threading.Event()
        self.host = socket.gethostname() or "?"  # no whitespace: heartbeats split on it

    def start(self, step: int) -> None:
        self.beat(step)
        self.publish()
        _daemon(self.run, "loom-step-watchdog")

    def beat(self, step: int) -> None:
        self.step, self.last_progress = step, time.monotonic()

    def stop(self) -> None:
        self.stopped.set()

    def run(self) -> None:
        while not self.stopped.wait(self.period_s):
            self.publish()
            if time.monotonic() - self.last_progress > self.timeout_s:
                self.fire()

    def publish(self) -> None:
        if self.store is not None:
            with contextlib.suppress(Exception):  # the store's host may be the stalled rank
                self.store.set(f"heartbeat/{self.rank}",
                               f"{self.step} {time.time()} {self.host}")

    def stalled(self) -> list[tuple[int, str | None, str]]:
        """(rank, its host if known, why) for each rank whose heartbeat is missing or older
        than 3 periods."""
        if self.store is None:
            return []
        stale: list[tuple[int, str | None, str]] = []
        now = time.time()
        for r in range(self.world):
            key = f"heartbeat/{r}"
            try:
                if not self.store.check([key]):
                    stale.append((r, None, "no heartbeat"))
                    continue
                step, when, *host = self.store.get(key).decode().split()
            except Exception:  # the store's host stopped answering
                stale.append((r, None, "store unreachable"))
                break
            if now - float(when) > 3 * self.period_s:
                stale.append((r, host[0] if host else None, f"silent since step {step}"))
        return stale

    def fire(self) -> None:
        try:
            try:
                with (self.outdir / f"hang-{self.rank}.txt").open("w") as f:
                    faulthandler.dump_traceback(f, all_threads=True)
                stacks = f"stacks in {self.outdir}/hang-<rank>.txt"
            except OSError as e:
                stacks = f"stacks not written ({e.strerror})"
            stalled = self.stalled()
            who = ", ".join(f"rank {r} ({host + ', ' if host else ''}{why})"
                            for r, host, why in stalled)
            who = f"stopped: {who}; " if stalled else ""
            collective = self.waiting_in(self.outdir, self.rank) if self.waiting_in else None
            where = f"waiting in {collective}; " if collective else ""
            report(f"loom: rank {self.rank}: no step finished for {self.timeout_s:g} s "
                   f"(--comm-timeout-s) after step {self.step}; {where}{who}{stacks}",
                   {"rank": self.rank, "waited_s": self.timeout_s, "collective": collective,
                    "stalled": [[r, host, why] for r, host, why in stalled
                                if r != self.rank]})
        finally:
            os._exit(FAILURE_EXIT)


def heartbeat_store(timeout_s: float) -> dist.Store | None:
    """A separate client of the job's store with a short timeout, so this thread never
    shares a connection with the main thread nor blocks on a stalled store host."""
    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not dist.is_initialized() or dist.get_world_size() == 1 or not addr or not port:
        return None
    try:
        store = dist.TCPStore(addr, int(port), is_master=False,
                              timeout=timedelta(seconds=min(10.0, timeout_s)))
    except Exception:
        return None
    return dist.PrefixStore("loom", store)
