"""Attempts of a launch: srun/mpiexec supervised line by line, and retries after a failure.

A failed attempt runs again up to `--retries` times; srun's own error lines name the node a
task failed on, which the next attempt leaves out while the allocation has spare nodes.
`--dry-run` shows each attempt's command the same way.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Callable

from loom.errors import BAD_INPUT_EXIT, SIGINT_EXIT, SIGTERM_EXIT
from loom.runtime.launch_commands import (
    BuildWithExclude,
    Command,
    slurm_allocation,
    slurm_nodes,
)
from loom.runtime.watchdog import LAUNCH_ATTEMPT_ENV

SRUN_FAILED_TASK = re.compile(r"^srun: error: (\S+): tasks? [\d,\-]+: (?!.*Terminated)")
"""srun's line for a task that failed by itself ("srun: error: nid003: task 5: Exited with
exit code 1", "...: task 2: Killed"); tasks it terminated because another failed say
"Terminated" and do not name the cause."""


def failed_host(stderr_line: str) -> str | None:
    match = SRUN_FAILED_TASK.match(stderr_line)
    return match.group(1) if match else None


def run_scheduler(command: Command) -> tuple[int, str | None]:
    """Run srun/mpiexec with its stderr passed through line by line, and return its exit
    code and the host of the first task it reports failed (srun's own error lines)."""
    try:
        proc = subprocess.Popen(command.argv, env={**os.environ, **command.env},
                                stderr=subprocess.PIPE, text=True, errors="replace")
    except FileNotFoundError:
        print(f"loom launch: {command.argv[0]} not found on PATH", file=sys.stderr)
        return 127, None
    first_failed = None
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            sys.stderr.write(line)
            first_failed = first_failed or failed_host(line)
        code = proc.wait()
    except KeyboardInterrupt:
        return SIGINT_EXIT, None
    return (code if code >= 0 else 128 - code), first_failed


NO_RETRY = (BAD_INPUT_EXIT, SIGTERM_EXIT, SIGINT_EXIT, 127)
"""Exits a retry cannot help: bad input is bad again, a preempted job (143) is the requeue
script's to restart, Ctrl-C is the user's, and a missing command stays missing."""


def exclusion(failed: str | None, excluded: tuple[str, ...], hosts: list[str],
              nodes: int) -> tuple[str, ...]:
    """The hosts the next attempt leaves out: `failed` too, while the allocation keeps
    `nodes` others."""
    if failed is None or failed in excluded or failed not in hosts:
        return excluded
    return (*excluded, failed) if len(hosts) - len(excluded) - 1 >= nodes else excluded


def run_with_retries(opts: argparse.Namespace, build: BuildWithExclude,
                     runner: Callable[[Command], tuple[int, str | None]]) -> int:
    """Run the command; after a failure run it again, up to `opts.retries` times, leaving
    out the node srun names as failed while there are spare nodes."""
    excluded: tuple[str, ...] = ()
    hosts, nodes = slurm_allocation(os.environ), slurm_nodes(opts, os.environ)
    for attempt in range(opts.retries + 1):
        os.environ[LAUNCH_ATTEMPT_ENV] = str(attempt)  # a retry's ranks resume the run
        code, failed = runner(build(excluded))
        if code == 0 or code in NO_RETRY or attempt == opts.retries:
            return code
        excluded_next = exclusion(failed, excluded, hosts, nodes)
        left_out = f", leaving out {failed}" if excluded_next != excluded else ""
        where = f" (a task failed on {failed})" if failed else ""
        print(f"loom launch: attempt {attempt + 1} exited {code}{where}; retry "
              f"{attempt + 1} of {opts.retries}{left_out}", file=sys.stderr, flush=True)
        excluded = excluded_next
    return code


def dry_run_lines(opts: argparse.Namespace, build: BuildWithExclude, hosts: list[str],
                  nodes: int) -> list[str]:
    """Each attempt's command line. No node has failed yet, so each retry is shown as if
    the first node of the attempt before it had failed (a comment line says so)."""
    lines, excluded = [str(build(()))], ()
    for retry in range(1, opts.retries + 1):
        used = [h for h in hosts if h not in excluded]
        failed = used[0] if used else None
        excluded_next = exclusion(failed, excluded, hosts, nodes)
        why = (f"if a task on {failed} failed: it is left out" if excluded_next != excluded
               else "no spare node to leave out" if hosts else "the same command")
        lines += [f"# retry {retry} of {opts.retries}, {why}", str(build(excluded_next))]
        excluded = excluded_next
    return lines
