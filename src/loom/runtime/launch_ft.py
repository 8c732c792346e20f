"""`loom launch --ft-replica-groups N`: torchft's lighthouse and N replica groups, on one
machine or, inside a Slurm or PBS job, each on its share of the job's nodes
(docs/faults.md).

The lighthouse (torchft's `LighthouseServer`, run inside this process, so it ends with the
launcher whatever ends it) forms each step's quorum. Each group is its own `loom launch` of
`-n / N` ranks with its own rendezvous, started as a child with the group's index and the
lighthouse's address in its environment (`$LOOM_FT_GROUP`, `$LOOM_FT_LIGHTHOUSE`: what
`loom train --ft-replica-groups` reads as its hidden `--ft-group` and `--ft-lighthouse`) and
this launcher's pid, which it watches (`loom.runtime.watchdog.watch_launcher`): a SIGKILLed
launcher leaves neither lighthouse nor group behind. `--max-restarts` restarts a failed
group's ranks (in a job: runs its srun or mpiexec again); the others keep training.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import IO

from loom.errors import BAD_INPUT_EXIT, LaunchError
from loom.runtime.launch_commands import NODES_ENV, job_port, pbs_hosts, slurm_allocation
from loom.runtime.watchdog import LAUNCHER_PID_ENV

GROUP_ENV = "LOOM_FT_GROUP"
LIGHTHOUSE_ENV = "LOOM_FT_LIGHTHOUSE"
"""The launcher's contract with each group's ranks (`ParallelConfig.ft_group`,
`ft_lighthouse`)."""
JOIN_TIMEOUT_S = 30.0
"""How long the lighthouse waits for a group it knows of (one alive, or in the last quorum)
to join a quorum before it forms one without it: a group restarted or late then recovers
from a peer at a later quorum. Under DiLoCo the groups meet only at syncs, so a restarted
group is healed only where its sync and the others' come within this of each other
(docs/faults.md): give `--ft-join-timeout-s` above the time of one sync cycle."""
MAX_JOIN_TIMEOUT_S = 86_400.0
JOIN_TIMEOUT_ENV = "LOOM_FT_JOIN_TIMEOUT_S"
"""The lighthouse's join timeout, handed to the groups: a rank waits for a quorum at least
that long (`ParallelConfig.ft_join_timeout_s`)."""
QUIET_RUST_LOG = "warn"
"""torchft's lighthouse and managers log every quorum at INFO; warnings and errors only."""


def check_groups(opts: argparse.Namespace, launcher: str, nproc: int) -> str | None:
    """The one-line reason `loom launch --ft-replica-groups` cannot start, or None."""
    groups = opts.ft_replica_groups
    if groups < 1:
        return f"--ft-replica-groups must be >= 1, got {groups}"
    if not 0 < opts.ft_join_timeout_s <= MAX_JOIN_TIMEOUT_S:  # NaN fails too
        return (f"--ft-join-timeout-s must be > 0 and <= {MAX_JOIN_TIMEOUT_S:g}, got "
                f"{opts.ft_join_timeout_s}")
    if opts.rdzv_endpoint:
        return "--ft-replica-groups gives each group its own rendezvous: not --rdzv-endpoint"
    if launcher == "local":
        if (opts.nnodes or 1) > 1:
            return ("--ft-replica-groups starts every group on this machine outside Slurm "
                    "or PBS: not --nnodes (inside a job each group takes its share of the "
                    "allocation's nodes)")
        if nproc % groups:
            return f"--ft-replica-groups {groups} does not divide -n {nproc}"
    else:
        try:
            group_nodes(opts, launcher, os.environ)
        except LaunchError as e:
            return str(e)
    os.environ.setdefault("RUST_LOG", QUIET_RUST_LOG)  # read when torchft loads
    try:
        import torchft  # noqa: F401  (the optional `ft` extra)
    except ImportError:
        return "--ft-replica-groups needs the torchft package: pip install 'loom[ft]'"
    return None


def group_nodes(opts: argparse.Namespace, launcher: str, environ: Mapping[str, str]
                ) -> list[list[str]]:
    """Inside Slurm or PBS: each group's share of the allocation's nodes, whole nodes in
    the allocation's order ([] on one machine)."""
    if launcher == "local":
        return []
    if launcher == "slurm":
        hosts = slurm_allocation(environ)
    else:
        nodefile = environ.get("PBS_NODEFILE")
        if not nodefile:
            raise LaunchError("PBS_NODEFILE is not set")
        hosts = pbs_hosts(nodefile)
    if not hosts:
        raise LaunchError(f"--ft-replica-groups: the {launcher} job names no nodes "
                          "(SLURM_JOB_NODELIST is not set)")
    nodes, groups = opts.nnodes or len(hosts), opts.ft_replica_groups
    if nodes > len(hosts):
        raise LaunchError(f"--nnodes {nodes}: the job has {len(hosts)} nodes")
    if nodes % groups:
        raise LaunchError(f"--ft-replica-groups {groups} does not divide the job's {nodes} "
                          "nodes (each group takes whole nodes)")
    per = nodes // groups
    return [hosts[g * per:(g + 1) * per] for g in range(groups)]


def group_argv(opts: argparse.Namespace, per_group: int, shares: list[list[str]]
               ) -> list[str]:
    """One group's own `loom launch`: on one machine torchrun's agent with `-n / N` ranks
    (its own standalone rendezvous; --max-restarts restarts its ranks); in a job srun or
    mpiexec on the group's nodes, run again on a failure (--retries) up to --max-restarts
    times."""
    launch = [sys.executable, "-m", "loom", "launch"]
    if not shares:
        return [*launch, "-n", str(per_group), "--max-restarts", str(opts.max_restarts),
                "--", *opts.cmd]
    per_node = ["-n", str(opts.nproc)] if opts.nproc else []
    return [*launch, *per_node, "--nnodes", str(len(shares[0])), "--retries",
            str(opts.max_restarts), "--", *opts.cmd]


def group_env(group: int, lighthouse: str, shares: list[list[str]],
              environ: Mapping[str, str], join_timeout_s: float) -> dict[str, str]:
    """What group `group`'s launch adds to the environment: its index, the lighthouse and
    its join timeout; in a job its nodes and its own rendezvous port (the job's, plus the
    group's index)."""
    env = {GROUP_ENV: str(group), LIGHTHOUSE_ENV: lighthouse,
           JOIN_TIMEOUT_ENV: repr(float(join_timeout_s))}
    if shares:
        job = environ.get("SLURM_JOB_ID") or environ.get("PBS_JOBID", "")
        port = int(environ.get("MASTER_PORT") or job_port(job))
        env.update({NODES_ENV: ",".join(shares[group]), "MASTER_PORT": str(port + group)})
    return env


def relay(stream: IO[str], seen: set[str], lock: threading.Lock) -> None:
    """A group's stderr, line by line, to ours; a bad-input or launcher line that another
    group already printed (every group refuses the same flags) is printed once."""
    for line in stream:
        with lock:
            if line.startswith(("error: ", "loom launch: ")):
                if line in seen:
                    continue
                seen.add(line)
            sys.stderr.write(line)
            sys.stderr.flush()


def run_groups(opts: argparse.Namespace, launcher: str, nproc: int) -> int:
    """Start the lighthouse and every group; wait for all of them. The exit code is the
    first failed group's (0 when every group finished)."""
    from torchft.coordination import LighthouseServer

    groups = opts.ft_replica_groups
    shares = group_nodes(opts, launcher, os.environ)
    lighthouse = LighthouseServer(bind="[::]:0", **lighthouse_settings(opts))
    procs: list[subprocess.Popen] = []
    relays: list[threading.Thread] = []
    seen: set[str] = set()
    lock = threading.Lock()
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    try:
        for s in previous:
            signal.signal(s, forward)
        for g in range(groups):
            env = {**os.environ, **group_env(g, lighthouse.address(), shares, os.environ,
                                             opts.ft_join_timeout_s),
                   LAUNCHER_PID_ENV: str(os.getpid())}
            proc = subprocess.Popen(group_argv(opts, nproc // groups, shares), env=env,
                                    stderr=subprocess.PIPE, text=True, errors="replace")
            procs.append(proc)
            relays.append(threading.Thread(target=relay, args=(proc.stderr, seen, lock),
                                           daemon=True))
            relays[-1].start()
        codes = [exit_code(p.wait()) for p in procs]
        for thread in relays:
            thread.join(timeout=10)
    finally:
        for p in procs:  # only after an exception here: a normal end has waited for each
            if p.poll() is None:
                p.kill()
                p.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)
        lighthouse.shutdown()
    failed = [(g, c) for g, c in enumerate(codes) if c]
    for g, code in failed:
        if code != BAD_INPUT_EXIT:  # a refusal is every group's, printed once already
            print(f"loom launch: replica group {g} exited {code}", file=sys.stderr)
    return failed[0][1] if failed else 0


def lighthouse_settings(opts: argparse.Namespace) -> dict[str, int]:
    """The lighthouse's settings, as it is started and as --dry-run shows it: any one group
    makes a quorum, after waiting up to the join timeout for the others it knows of."""
    return {"min_replicas": 1, "join_timeout_ms": round(opts.ft_join_timeout_s * 1000)}


def exit_code(returncode: int) -> int:
    """A child's exit as a shell reports it: 128 + N for a child killed by signal N."""
    return returncode if returncode >= 0 else 128 - returncode


def dry_run_lines(opts: argparse.Namespace, launcher: str, nproc: int) -> list[str]:
    """What --dry-run prints: the lighthouse, then each group's launch."""
    groups = opts.ft_replica_groups
    shares = group_nodes(opts, launcher, os.environ)
    settings = ", ".join(f"{k}={v}" for k, v in lighthouse_settings(opts).items())
    lines = [f"# torchft LighthouseServer({settings}) in this process, at ADDRESS"]
    for g in range(groups):
        env = group_env(g, "ADDRESS", shares, os.environ, opts.ft_join_timeout_s)
        assignments = " ".join(f"{k}={v}" for k, v in env.items())
        lines.append(f"{assignments} {shlex.join(group_argv(opts, nproc // groups, shares))}")
    return lines
