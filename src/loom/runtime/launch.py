"""`loom launch`: start a command on every rank with the launcher that fits the environment.

Inside a Slurm allocation that is `srun`, inside a PBS job `mpiexec` (MPICH/PALS flags, as on
Polaris and Aurora), otherwise torch's elastic agent, run in this process so that a failed rank
becomes one line instead of a wall of agent tracebacks. Each `*_command` builder is a pure
function of the options, the environment and the `Host`, so `--dry-run` shows what would run.

The builders live in `launch_commands`, the in-process agent in `launch_agent`, srun/mpiexec
supervision and retries in `launch_retries`; this module parses the options and picks.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from loom.errors import LaunchError
from loom.runtime.launch_agent import run_local
from loom.runtime.launch_commands import (
    choose_launcher,
    detect_host,
    scheduler_builder,
    slurm_allocation,
    slurm_nodes,
)
from loom.runtime.launch_ft import JOIN_TIMEOUT_S, check_groups, run_groups
from loom.runtime.launch_ft import dry_run_lines as ft_dry_run_lines
from loom.runtime.launch_retries import dry_run_lines, run_scheduler, run_with_retries
from loom.runtime.watchdog import watch_launcher

USAGE = (
    "loom launch [-n NPROC] [--nnodes N] [--node-rank R] [--rdzv-endpoint HOST:PORT]\n"
    "                   [--rdzv-id ID] [--rdzv-backend c10d] [--rdzv-conf K=V,...]\n"
    "                   [--local-addr ADDR] [--max-restarts 0] [--retries 0] [--dry-run]\n"
    "                   [--ft-replica-groups N] [--ft-join-timeout-s S]\n"
    "                   [--] CMD..."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loom launch",
        usage=USAGE,
        description="Start CMD on every rank: srun inside Slurm, mpiexec inside PBS, "
        "torch's elastic agent otherwise. A rank that fails ends the job.",
        allow_abbrev=False,  # CMD's own flags are CMD's: --ft is loom train's, not ours
    )
    add = parser.add_argument
    add("-n", "--nproc", type=int, help="ranks per node [the job's, else accelerators, else 1]")
    add("--nnodes", type=int, metavar="N", help="nodes [the allocation's, else 1]")
    add("--node-rank", type=int, default=0, metavar="R", help="this node's rank [0]")
    add("--rdzv-endpoint", metavar="HOST:PORT", help="rendezvous address [in a job: first host]")
    add("--rdzv-id", default="loom", metavar="ID", help="job id shared by all nodes [loom]")
    add("--rdzv-backend", default="c10d", metavar="BACKEND", help="rendezvous backend [c10d]")
    add("--rdzv-conf", metavar="K=V,...", help="rendezvous options for torchrun, e.g. "
        "is_host=1 on the node that serves --rdzv-endpoint when it does not recognise that "
        "address as its own (a second network interface)")
    add("--local-addr", metavar="ADDR", help="this node's address as the other nodes reach "
        "it [torch looks it up from the hostname]")
    add("--max-restarts", type=int, default=0, metavar="N", help="local job restarts [0]")
    add("--retries", type=int, default=0, metavar="N",
        help="run srun/mpiexec (or the local agent) again after a failure, up to N times; "
        "srun leaves out the failed node while the allocation has spare nodes [0]")
    add("--dry-run", action="store_true", help="print the command instead of running it")
    add("--ft-replica-groups", type=int, default=1, metavar="N",
        help="start torchft's lighthouse and N fault-tolerant replica groups, every group its "
        "own launch: -n / N ranks each on one machine, the job's nodes / N each in a Slurm "
        "or PBS job (CMD takes --ft-replica-groups N; docs/faults.md) [1]")
    add("--ft-join-timeout-s", type=float, default=JOIN_TIMEOUT_S, metavar="S",
        help="--ft-replica-groups: how long torchft's lighthouse waits for a live group to "
        "join a quorum before it forms one without it; under --ft diloco give more than one "
        f"sync cycle takes (docs/faults.md) [{JOIN_TIMEOUT_S:g}]")
    add("cmd", nargs=argparse.REMAINDER, metavar="CMD", help="what every rank runs")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    opts = build_parser().parse_args(argv)
    if opts.cmd[:1] == ["--"]:
        opts.cmd = opts.cmd[1:]
    return opts


def main(argv: list[str]) -> int:
    watch_launcher()  # a replica group's launch ends with the launcher that started it
    try:
        opts = parse_args(argv)
    except SystemExit as exit_:  # --help or a usage error, already printed
        return int(exit_.code or 0)
    if not opts.cmd:
        print("loom launch: no command given", file=sys.stderr)
        return 2
    for name, value in (("-n", opts.nproc), ("--nnodes", opts.nnodes)):
        if value is not None and value < 1:
            print(f"loom launch: {name} must be >= 1, got {value}", file=sys.stderr)
            return 2
    if opts.retries < 0:
        print(f"loom launch: --retries must be >= 0, got {opts.retries}", file=sys.stderr)
        return 2
    launcher = choose_launcher(os.environ)
    host = detect_host()
    if opts.ft_replica_groups != 1:
        return replica_groups(opts, launcher, opts.nproc or host.accelerators or 1)
    build = scheduler_builder(launcher, opts, host)
    try:
        build(())  # a bad environment is reported here, before anything runs
        if opts.dry_run:
            hosts = slurm_allocation(os.environ) if launcher == "slurm" else []
            print("\n".join(dry_run_lines(opts, build, hosts, slurm_nodes(opts, os.environ))))
            return 0
    except (LaunchError, OSError) as err:
        print(f"loom launch: {err}", file=sys.stderr)
        return 2
    if launcher != "local":
        return run_with_retries(opts, build, run_scheduler)
    if not shutil.which(opts.cmd[0]):
        print(f"loom launch: command not found: {opts.cmd[0]}", file=sys.stderr)
        return 127
    return run_with_retries(opts, build, lambda command: (run_local(command), None))


def replica_groups(opts: argparse.Namespace, launcher: str, nproc: int) -> int:
    """--ft-replica-groups: the lighthouse and the groups (`launch_ft`)."""
    problem = check_groups(opts, launcher, nproc)
    if problem:
        print(f"loom launch: {problem}", file=sys.stderr)
        return 2
    if opts.dry_run:
        print("\n".join(ft_dry_run_lines(opts, launcher, nproc)))
        return 0
    return run_groups(opts, launcher, nproc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
