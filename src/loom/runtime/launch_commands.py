"""The command each launcher gets: srun in a Slurm job, mpiexec in a PBS job, torchrun
otherwise.

`loom launch` and `loom doctor` both need to know what would run without running it, so
every `*_command` builder here is a pure function of the options, the environment and the
`Host` (passed in so the builders stay testable); nothing here starts a process.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from loom.errors import LaunchError
from loom.safe_io import read_bytes_capped

MAX_NODEFILE_BYTES = 16 << 20
"""The largest PBS_NODEFILE read."""

EARLY_EXIT_GRACE_S = 10
"""How long the other ranks may run on after one has exited 0 before the job is ended as a
failure (the local agent; srun's `--wait`). A finished job's ranks leave within about a
second of each other, after their last barrier; a rank that leaves early would otherwise
leave the others blocked until --comm-timeout-s."""

DEFAULT_PORT = "29500"
JOB_PORTS = (15000, 15000)
"""(first, count) of the rendezvous ports a Slurm or PBS job's id picks from: below Linux's
ephemeral range (32768+), so no outgoing connection holds one; consecutive job ids sharing
a node get different ports (a fixed 29500 made the second job's rendezvous fail)."""
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
NODES_ENV = "LOOM_LAUNCH_NODES"
"""The hosts of the allocation this launch runs on, comma-separated, where it is given
only a share of them: `loom launch --ft-replica-groups` gives each group's own launch its
group's nodes (srun `--nodelist`, mpiexec `--hosts`)."""


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
    """The allocation's hosts ([] when Slurm did not say); this launch's share where it has
    one ($LOOM_LAUNCH_NODES)."""
    share = given_nodes(environ)
    if share:
        return share
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    return slurm_hosts(nodelist) if nodelist else []


def given_nodes(environ: Mapping[str, str]) -> list[str]:
    """The hosts $LOOM_LAUNCH_NODES gives this launch ([]: the whole allocation)."""
    return [h for h in environ.get(NODES_ENV, "").split(",") if h]


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
    if given_nodes(environ):  # a replica group's own nodes, its rank 0 on the first
        argv.append("--nodelist=" + ",".join(hosts))
    if exclude:
        argv.append("--exclude=" + ",".join(exclude))
    argv += ["--kill-on-bad-exit=1", f"--wait={EARLY_EXIT_GRACE_S}"]
    if cpus_on_node and cpus_on_node >= nproc:
        argv.append(f"--cpus-per-task={cpus_on_node // nproc}")
    argv.append(",".join(["--export=ALL", *(f"{k}={v}" for k, v in exports.items())]))
    return Command([*argv, *opts.cmd])


def pbs_hosts(nodefile: str) -> list[str]:
    """The job's hosts, in PBS_NODEFILE's order, each once."""
    try:  # one line per rank slot: 16 MiB is ~500,000 hosts
        text = read_bytes_capped(Path(nodefile), MAX_NODEFILE_BYTES, follow=True).decode()
    except (OSError, ValueError) as e:  # a FIFO or a device too: refused, never read
        raise LaunchError(f"PBS_NODEFILE {nodefile}: {e}") from None
    hosts = list(dict.fromkeys(text.split()))
    if not hosts:
        raise LaunchError(f"PBS_NODEFILE {nodefile} lists no hosts")
    return hosts


def pbs_command(opts: argparse.Namespace, environ: Mapping[str, str], host: Host) -> Command:
    """MPICH/PALS mpiexec; `--cpu-bind depth -d` gives each rank an even share of cores."""
    nodefile = environ.get("PBS_NODEFILE")
    if not nodefile:
        raise LaunchError("PBS_NODEFILE is not set")
    hosts = given_nodes(environ) or pbs_hosts(nodefile)
    nodes = opts.nnodes or len(hosts)
    nproc = opts.nproc or host.accelerators or 1
    env = {**_master(opts, environ, hosts[0], job_port(environ.get("PBS_JOBID", ""))),
           **omp_threads(environ, host, nproc)}
    argv = ["mpiexec", "-n", str(nodes * nproc), "--ppn", str(nproc)]
    argv += ["--hosts", ",".join(hosts)] if given_nodes(environ) else ["--hostfile", nodefile]
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
