"""torch's elastic agent run inside `loom launch`, so a failed rank is one line.

The agent would print a wall of tracebacks for a failed rank; run in this process, its
failure comes back as an exception, and this module turns the rank's error file (and the
watchdogs' hang reports) into the one line that names the cause. It also makes the agent
SIGKILL a stopped rank at once instead of waiting out its SIGTERM grace.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loom.errors import BAD_INPUT_EXIT
from loom.runtime.launch_commands import EARLY_EXIT_GRACE_S, TORCHRUN, Command
from loom.runtime.watchdog import HANG_KEY, LAUNCHER_PID_ENV

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

def _quiet_elastic_logs() -> None:
    """The agent logs every start and stop; what matters comes back as an exception."""
    for name in ("torch.distributed.elastic", "torch.distributed.run"):
        logger = logging.getLogger(name)
        logger.addHandler(logging.NullHandler())
        logger.propagate = False


def stopped(pid: int) -> bool:
    """Whether `pid` is stopped (SIGSTOP, SIGTSTP, or a debugger's stop); False where
    /proc cannot tell."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[:1] in (["T"], ["t"])


def _kill_stopped_ranks_at_once() -> None:
    """When a rank fails, the agent ends the others with SIGTERM and SIGKILLs them 30 s
    later. A stopped rank acts on neither SIGTERM nor anything else until continued, so a
    job whose rank was stopped outlived the watchdog's --comm-timeout-s by those 30 s; it
    gets SIGKILL at once instead. (Continuing it would let its own watchdog, long past
    its timeout, report a hang of its own and hide which rank stopped.)"""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler,
    )

    handler = subprocess_handler.SubprocessHandler
    close = handler.close
    if getattr(close, "kills_stopped", False):
        return

    def close_or_kill(self: Any, death_sig: signal.Signals | None = None) -> None:
        close(self, signal.SIGKILL if stopped(self.proc.pid) else death_sig)

    close_or_kill.kills_stopped = True  # type: ignore[attr-defined]
    handler.close = close_or_kill


def _end_a_job_left_early() -> None:
    """The agent waits until every rank has exited or one has failed, so a rank that exits
    0 while the others still train left them blocked in a collective until
    --comm-timeout-s (600 s). Wrapped here: once a rank has exited 0 and another still
    runs `EARLY_EXIT_GRACE_S` later, the first rank to have left is reported failed (exit
    code 0) and the agent ends the others. Ranks of a finished job leave together (the
    barrier of `loom.runtime.distributed.teardown`), well inside the grace. Torch's private
    `SubprocessContext._poll` and `_failures`, checked on 2.11.0, 2.13.0 and 2.15.0."""
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    poll = SubprocessContext._poll
    if getattr(poll, "ends_early_exits", False):
        return

    def poll_or_end(self: Any) -> Any:
        result = poll(self)
        done = sorted(set(self.subprocess_handlers) - self._running_local_ranks)
        if result is not None or not done:
            return result
        first = self.__dict__.setdefault("loom_first_exit", time.monotonic())
        if time.monotonic() - first < EARLY_EXIT_GRACE_S:
            return None
        rank = done[0]  # the exit order within one poll is not known: the lowest is named
        self._failures[rank] = ProcessFailure(
            local_rank=rank, pid=self.subprocess_handlers[rank].proc.pid, exitcode=0,
            error_file=self.error_files[rank])
        return poll(self)  # with a failure recorded it ends the ranks still running

    poll_or_end.ends_early_exits = True  # type: ignore[attr-defined]
    SubprocessContext._poll = poll_or_end


SECONDARY_ERRORS = ("lost contact with another rank",)
"""Lines of ranks that failed because of another rank: the cause is named elsewhere."""


def error_file(failure: ProcessFailure) -> dict:
    """What a rank left in its torchelastic error file ({} if nothing readable)."""
    try:
        data = json.loads(Path(failure.error_file).read_text())
    except (OSError, ValueError, TypeError):
        return {}
    return data if isinstance(data, dict) else {}


def last_error_line(failure: ProcessFailure) -> str:
    """The one line a rank left in its torchelastic error file ('' if none)."""
    message = error_file(failure).get("message")
    return message if isinstance(message, str) else ""


def hang_line(hangs: dict[int, dict], first: int) -> str | None:
    """'rank 1 (host-a) never entered all_gather #12 on dp_shard (layers.3); ranks 0,2
    waited 20 s' from the watchdogs' reports (`loom.runtime.watchdog`, rank -> its facts): the
    ranks a waiting rank found silent, the collective it waited in (that of `first`, the
    cause reported, when it is one of them) and every rank that waited. None when no rank
    was named silent."""
    if not hangs:
        return None
    facts = hangs.get(first) or hangs[min(hangs)]
    silent = [(r, host, why) for r, host, why in facts.get("stalled") or []
              if r not in hangs]
    if not silent:
        return None
    who = ", ".join(f"rank {r} ({host or 'host unknown'})" for r, host, _ in silent)
    collective = facts.get("collective")
    what = f"never entered {collective}" if collective else \
        f"stopped ({'; '.join(why for _, _, why in silent)})"
    waited = sorted(hangs)
    ranks = f"rank {waited[0]}" if len(waited) == 1 else \
        f"ranks {','.join(map(str, waited))}"
    return f"{who} {what}; {ranks} waited {facts.get('waited_s', 0):g} s"


def first_cause(err: ChildFailedError, lines: dict[int, str]) -> tuple[int, ProcessFailure]:
    """The failure to report: the earliest that is not a consequence of another rank's
    (a lost peer, or the agent's SIGTERM to the ranks still running)."""
    def consequence(rank: int, failure: ProcessFailure) -> bool:
        return any(s in lines[rank] for s in SECONDARY_ERRORS) or \
            failure.exitcode == -signal.SIGTERM

    return min(err.failures.items(),
               key=lambda item: (consequence(*item), item[1].timestamp, item[0]))


def _report_failure(err: ChildFailedError) -> int:
    lines = {rank: last_error_line(f) for rank, f in err.failures.items()}
    rank, failure = first_cause(err, lines)
    code, line = failure.exitcode, lines[rank]
    if code == BAD_INPUT_EXIT:
        if lines.get(0) != line or not line:  # rank 0 prints the line before leaving it
            print(line or f"loom launch: rank {rank} reported a configuration error",
                  file=sys.stderr)
        return code
    if code == 0:  # left early (see `_end_a_job_left_early`): the others were ended
        running = sum(1 for f in err.failures.values() if f.exitcode == -signal.SIGTERM)
        print(f"loom launch: rank {rank} (local {failure.local_rank}, host "
              f"{socket.gethostname()}) exited 0 while {running or 'other'} rank(s) still "
              f"ran; ended the job after {EARLY_EXIT_GRACE_S:g} s", file=sys.stderr)
        return 1
    hangs = {r: data[HANG_KEY] for r, f in err.failures.items()
             if isinstance((data := error_file(f)).get(HANG_KEY), dict)}
    hung = hang_line(hangs, rank)
    if hung:  # each waiting rank printed its own line, with where its stacks are
        print(f"loom launch: {hung}", file=sys.stderr)
        return code if code > 0 else 128 - code
    how = f"failed with exit code {code}" if code > 0 else f"was killed by {failure.signal_name()}"
    others = sum(1 for r, f in err.failures.items() if r != rank and f.exitcode > 0)
    more = f"; {others} other rank(s) failed too" if others else ""
    why = f": {line}" if line else ""
    print(f"loom launch: rank {rank} (local {failure.local_rank}) {how}{more}{why}",
          file=sys.stderr)
    return code if code > 0 else 128 - code


def run_local(command: Command) -> int:
    """Run torchrun's agent in this process: its failures become one line, not tracebacks.

    Unlike the printed command, the agent gets a temporary --log-dir, removed on every exit
    but SIGKILL, for the redirected stdout and the error files of the ranks. The workers get
    this process's pid, so they end themselves if it dies (see `loom.runtime.watchdog`).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import get_args_parser, run

    _quiet_elastic_logs()
    _kill_stopped_ranks_at_once()
    _end_a_job_left_early()
    os.environ.update({**command.env, LAUNCHER_PID_ENV: str(os.getpid())})
    with tempfile.TemporaryDirectory(prefix="loom-launch-", ignore_cleanup_errors=True) as log_dir:
        args = get_args_parser().parse_args(command.argv[len(TORCHRUN) :])
        args.log_dir = log_dir
        try:
            run(args)
        except ChildFailedError as err:
            return _report_failure(err)
        except RendezvousError as err:
            print(f"loom launch: rendezvous failed: {err}", file=sys.stderr)
            return 1
        except SignalException as err:
            print(f"loom launch: stopped by {err.sigval.name}", file=sys.stderr)
            return 128 + err.sigval
    return 0
