"""`loom launch`: start a command on every rank with the launcher that fits the environment.

Inside a Slurm allocation that is `srun`, inside a PBS job `mpiexec` (MPICH/PALS flags, as on
Polaris and Aurora), otherwise torch's elastic agent, run in this process so that a failed rank
becomes one line instead of a wall of agent tracebacks. Each `*_command` builder is a pure
function of the options, the environment and the `Host`, so `--dry-run` shows what would run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loom.errors import BAD_INPUT_EXIT, SIGINT_EXIT, SIGTERM_EXIT, LaunchError
from loom.runtime.watchdog import HANG_KEY, LAUNCH_ATTEMPT_ENV, LAUNCHER_PID_ENV

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

DEFAULT_PORT = "29500"
JOB_PORTS = (15000, 15000)
"""(first, count) of the rendezvous ports a Slurm or PBS job's id picks from: below Linux's
ephemeral range (32768+), so no outgoing connection holds one; consecutive job ids sharing
a node get different ports (a fixed 29500 made the second job's rendezvous fail)."""
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


@dataclass(frozen=True)
class Host:
    """What this machine offers; passed in so the builders stay testable."""

    cpus: int
    accelerators: int


@dataclass(frozen=True)
class Command:
    """A launcher's argv plus the variables it adds to the inherited environment."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        assignments = [f"{name}={shlex.quote(value)}" for name, value in self.env.items()]
        return " ".join([*assignments, shlex.join(self.argv)])


USAGE = (
    "loom launch [-n NPROC] [--nnodes N] [--node-rank R] [--rdzv-endpoint HOST:PORT]\n"
    "                   [--rdzv-id ID] [--rdzv-backend c10d] [--rdzv-conf K=V,...]\n"
    "                   [--local-addr ADDR] [--max-restarts 0] [--retries 0] [--dry-run]\n"
    "                   [--] CMD..."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loom launch",
        usage=USAGE,
        description="Start CMD on every rank: srun inside Slurm, mpiexec inside PBS, "
        "torch's elastic agent otherwise. A rank that fails ends the job.",
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
    add("cmd", nargs=argparse.REMAINDER, metavar="CMD", help="what every rank runs")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    opts = build_parser().parse_args(argv)
    if opts.cmd[:1] == ["--"]:
        opts.cmd = opts.cmd[1:]
    return opts


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host list ("nid[001-003,007],login1") where scontrol is absent."""
    hosts = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        parts = re.split(r"\[([^\]]*)\]", item)  # text, ranges, text, ..., text
        choices = [_expand_ranges(p) if i % 2 else [p] for i, p in enumerate(parts)]
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


def _expand_ranges(spec: str) -> list[str]:
    numbers = []
    for part in spec.split(","):
        low, _, high = part.partition("-")
        numbers += [str(i).zfill(len(low)) for i in range(int(low), int(high or low) + 1)]
    return numbers


def slurm_hosts(nodelist: str) -> list[str]:
    """scontrol knows every nodelist form; our parser covers the common ones off-cluster."""
    if shutil.which("scontrol"):
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False
        )
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()
    return expand_nodelist(nodelist)


def omp_threads(
    environ: Mapping[str, str], host: Host, nproc: int, cpus: int | None = None
) -> dict[str, str]:
    """Share a CPU node's cores among its ranks; torchrun alone would give each rank one."""
    if "OMP_NUM_THREADS" in environ or host.accelerators:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (cpus or host.cpus) // nproc))}


def _env_int(environ: Mapping[str, str], *names: str) -> int | None:
    """The first of `names` that is set, as a number; Slurm counts can read "4(x2)"."""
    for name in names:
        match = re.match(r"\d+", environ.get(name, ""))
        if match:
            return int(match.group())
    return None


def _flags(**values: object) -> list[str]:
    return [f"--{name.replace('_', '-')}={value}" for name, value in values.items()]


def job_port(job_id: str) -> str:
    """The rendezvous port of a scheduler job: its numeric id (`1234`, PBS's `1234.server`)
    modulo the range, else a CRC of the whole id (array jobs: `1234[5].server`)."""
    first, count = JOB_PORTS
    numeric = re.fullmatch(r"(\d+)(\..*)?", job_id)
    key = int(numeric.group(1)) if numeric else zlib.crc32(job_id.encode())
    return str(first + key % count)


def _master(
    opts: argparse.Namespace, environ: Mapping[str, str], first_host: str,
    default_port: str = DEFAULT_PORT,
) -> dict[str, str]:
    """MASTER_ADDR/PORT: --rdzv-endpoint, else the first host and $MASTER_PORT, else
    `default_port` (a scheduler job's own, from `job_port`)."""
    if opts.rdzv_endpoint:
        addr, _, port = opts.rdzv_endpoint.partition(":")
        return {"MASTER_ADDR": addr, "MASTER_PORT": port or default_port}
    return {"MASTER_ADDR": first_host, "MASTER_PORT": environ.get("MASTER_PORT", default_port)}


def slurm_nodes(opts: argparse.Namespace, environ: Mapping[str, str]) -> int:
    return opts.nnodes or _env_int(environ, "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or 1


def slurm_allocation(environ: Mapping[str, str]) -> list[str]:
    """The allocation's hosts ([] when Slurm did not say)."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    return slurm_hosts(nodelist) if nodelist else []


def slurm_command(opts: argparse.Namespace, environ: Mapping[str, str], host: Host,
                  exclude: tuple[str, ...] = ()) -> Command:
    """srun ends the whole step when one task fails (--kill-on-bad-exit). `exclude`: hosts a
    retry leaves out (`srun --exclude`); the rendezvous moves to the first host left."""
    nodes = slurm_nodes(opts, environ)
    nproc = opts.nproc or _env_int(environ, "SLURM_NTASKS_PER_NODE", "SLURM_GPUS_ON_NODE") or 1
    hosts = [h for h in slurm_allocation(environ) if h not in exclude]
    if not hosts and not opts.rdzv_endpoint:
        raise LaunchError("SLURM_JOB_NODELIST is not set; pass --rdzv-endpoint HOST:PORT")
    cpus_on_node = _env_int(environ, "SLURM_CPUS_ON_NODE")
    exports = {
        **_master(opts, environ, hosts[0] if hosts else "",
                  job_port(environ.get("SLURM_JOB_ID", ""))),
        **omp_threads(environ, host, nproc, cpus_on_node),
    }
    argv = ["srun", *_flags(nodes=nodes, ntasks=nodes * nproc, ntasks_per_node=nproc)]
    if exclude:
        argv.append("--exclude=" + ",".join(exclude))
    argv.append("--kill-on-bad-exit=1")
    if cpus_on_node and cpus_on_node >= nproc:
        argv.append(f"--cpus-per-task={cpus_on_node // nproc}")
    argv.append(",".join(["--export=ALL", *(f"{k}={v}" for k, v in exports.items())]))
    return Command([*argv, *opts.cmd])


def pbs_command(opts: argparse.Namespace, environ: Mapping[str, str], host: Host) -> Command:
    """MPICH/PALS mpiexec; `--cpu-bind depth -d` gives each rank an even share of cores."""
    nodefile = environ.get("PBS_NODEFILE")
    if not nodefile:
        raise LaunchError("PBS_NODEFILE is not set")
    hosts = list(dict.fromkeys(Path(nodefile).read_text().split()))
    if not hosts:
        raise LaunchError(f"PBS_NODEFILE {nodefile} lists no hosts")
    nodes = opts.nnodes or len(hosts)
    nproc = opts.nproc or host.accelerators or 1
    env = {**_master(opts, environ, hosts[0], job_port(environ.get("PBS_JOBID", ""))),
           **omp_threads(environ, host, nproc)}
    argv = ["mpiexec", "-n", str(nodes * nproc), "--ppn", str(nproc), "--hostfile", nodefile]
    argv += ["--cpu-bind", "depth", "-d", str(max(1, host.cpus // nproc))]
    for name, value in env.items():
        argv += ["--env", f"{name}={value}"]
    return Command([*argv, *opts.cmd])


def local_command(opts: argparse.Namespace, environ: Mapping[str, str], host: Host) -> Command:
    """torchrun with --no-python, so CMD (`loom train ...`) runs as it is.

    Ranks other than local rank 0 have only their stdout redirected (to a log dir), so the
    console shows rank 0's output and every rank's stderr.
    """
    nproc = opts.nproc or host.accelerators or 1
    nnodes = opts.nnodes or 1
    argv = [*TORCHRUN, *_flags(nproc_per_node=nproc, max_restarts=opts.max_restarts)]
    if nproc > 1:
        argv.append("--redirects=" + ",".join(f"{r}:{min(r, 1)}" for r in range(nproc)))
    if nnodes == 1 and not opts.rdzv_endpoint:
        argv.append("--standalone")
    elif not opts.rdzv_endpoint:
        raise LaunchError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT")
    else:
        argv += _flags(nnodes=nnodes, node_rank=opts.node_rank, rdzv_backend=opts.rdzv_backend)
        argv += _flags(rdzv_endpoint=opts.rdzv_endpoint, rdzv_id=opts.rdzv_id)
        if opts.rdzv_conf:
            argv += _flags(rdzv_conf=opts.rdzv_conf)
        if opts.local_addr:
            argv += _flags(local_addr=opts.local_addr)
    return Command([*argv, "--no-python", *opts.cmd], omp_threads(environ, host, nproc))


def choose_launcher(environ: Mapping[str, str]) -> str:
    if "SLURM_JOB_ID" in environ:
        return "slurm"
    return "pbs" if "PBS_JOBID" in environ else "local"


BUILDERS = {"slurm": slurm_command, "pbs": pbs_command, "local": local_command}
BuildWithExclude = Callable[[tuple[str, ...]], Command]
"""A launcher's command for the hosts to leave out (only srun can leave hosts out)."""


def scheduler_builder(launcher: str, opts: argparse.Namespace, host: Host) -> BuildWithExclude:
    """The command builder of `launcher`, as a function of the hosts a retry leaves out."""
    if launcher == "slurm":
        return lambda exclude: slurm_command(opts, os.environ, host, exclude)
    return lambda exclude: BUILDERS[launcher](opts, os.environ, host)


def detect_host() -> Host:
    import torch

    accelerators = torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    return Host(cpus=os.cpu_count() or 1, accelerators=accelerators)


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


def main(argv: list[str]) -> int:
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
