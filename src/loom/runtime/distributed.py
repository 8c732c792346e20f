"""Process-level setup: who am I, which device and backend, seeding, orderly teardown.

The environment is read here, once. torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; mpiexec and
srun set their own variables, which are mapped onto the same fields.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from loom.runtime import flight
from loom.runtime.host_hygiene import expandable_segments
from loom.runtime.watchdog import LAUNCH_ATTEMPT_ENV

logger = logging.getLogger("loom")

_RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
_WORLD_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_NTASKS")
_RESTART_VARS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", LAUNCH_ATTEMPT_ENV)
"""Set by torch's elastic agent on every (re)start of the workers, by Slurm on a requeued
job's later runs, and by `loom launch --retries` on each retry; the largest counts (a
retried launch starts a fresh agent, whose own count is 0 again)."""
_LOCAL_RANK_VARS = ("LOCAL_RANK", "PALS_LOCAL_RANKID", "MPI_LOCALRANKID",
                    "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")


def summed(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`tensor` summed in place over `group` (None: every rank), and returned. On a group of
    one rank it is already the sum, so nothing is issued: a one-process step (or a layout
    whose loss mesh is one rank) sends no collective, on any layout, without a branch in the
    callers."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, group=group)
    return tensor


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    restarts: int = 0
    """How often the launcher has started this job's ranks again (torchrun's
    --max-restarts, a Slurm requeue): 0 on the first attempt."""
    agent_store: bool = False
    """torch's elastic agent hosts the job's store (rank 0 must not start one)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _first(environ: Mapping[str, str], names: tuple[str, ...], default: int) -> int:
    for name in names:
        if environ.get(name, "") != "":
            return int(environ[name])
    return default


def rank_info(environ: Mapping[str, str] | None = None) -> RankInfo:
    """Rank, world and local rank from torchrun, MPI/PMI or Slurm variables (1 process if none)."""
    env = os.environ if environ is None else environ
    return RankInfo(
        rank=_first(env, _RANK_VARS, 0),
        world_size=_first(env, _WORLD_VARS, 1),
        local_rank=_first(env, _LOCAL_RANK_VARS, 0),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", "29500")),
        restarts=max(_first(env, (name,), 0) for name in _RESTART_VARS),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )


def pick_device(local_rank: int) -> torch.device:
    """The accelerator for this rank if there is one (cuda, xpu, mps), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu", local_rank % torch.xpu.device_count())
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return {"cuda": "nccl", "xpu": "xccl"}.get(device.type, "gloo")


def prepare_device(info: RankInfo) -> torch.device:
    """This rank's device, made current, its allocator configured before the first
    allocation on it."""
    device = pick_device(info.local_rank)
    expandable_segments(device)
    if device.type in ("cuda", "xpu"):
        getattr(torch, device.type).set_device(device)
    return device


def init_distributed(info: RankInfo, timeout_s: float = 600.0) -> torch.device:
    """Choose and set the device, then start the process group (a store-only one for a
    single plain process, so the mesh code paths are the same at world size 1; the model
    itself stays unwrapped there, see `loom.parallel.single`).
    A collective that waits longer than `timeout_s` for a peer fails instead of hanging."""
    device = prepare_device(info)
    backend = backend_for(device)
    flight.enable()  # a hang report can then name the collective a rank waits in
    if info.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend, store=job_store(info, timeout), rank=info.rank,
            world_size=info.world_size, timeout=timeout,
            device_id=device if device.type in ("cuda", "xpu") else None)
    return device


def job_store(info: RankInfo, timeout: timedelta) -> dist.Store:
    """The store the process group meets in, with this attempt's own key space. Under
    torch's elastic agent the ranks use the agent's store, which outlives a restart: the
    previous attempt's keys (a dead rank's gloo address) would be read as this attempt's,
    and the group would try to connect to a process that is gone."""
    store = dist.TCPStore(info.master_addr, info.master_port, info.world_size,
                          is_master=info.rank == 0 and not info.agent_store, timeout=timeout,
                          multi_tenant=not info.agent_store)
    return dist.PrefixStore(f"loom/attempt-{info.restarts}", store)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)


def teardown() -> None:
    """Barrier then destroy, so no rank tears down gloo while another still talks to it.
    First the run's objects that sit in reference cycles (the model and its FSDP state,
    which holds collective handles) are collected while the interpreter is whole: left to
    its shutdown, a gloo thread still holding such work can abort the process
    (pytorch/pytorch#179291)."""
    gc.collect()
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def in_current_group(info: RankInfo) -> RankInfo:
    """`info` with the rank and size of the process group already up, if one is (a caller's
    own group wins over the environment)."""
    if not dist.is_initialized():
        return info
    return replace(info, rank=dist.get_rank(), world_size=dist.get_world_size())


def abandon(world_size: int) -> None:
    """After a failure: one process destroys its group at once (no peer to wait for, so no
    barrier). With several the group is left to the process's exit: a peer may be blocked
    in a collective with this rank, and destroying a gloo group first waits for its pending
    work, up to the collective timeout, where a failed rank must end at once."""
    gc.collect()
    if world_size == 1 and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def process_group(info: RankInfo, timeout_s: float = 600.0
                  ) -> Iterator[tuple[RankInfo, torch.device]]:
    """The job's process group for the block, with this rank's place in it and its device.
    Started here if none is up, and then torn down after: by `teardown` on success, by
    `abandon` on failure. A group the caller started is used as it is (its rank and size
    win over the environment's) and left up."""
    if dist.is_initialized():
        yield in_current_group(info), prepare_device(info)
        return
    with caller_excepthook():
        device = init_distributed(info, timeout_s)
        try:
            yield info, device
        except BaseException:
            abandon(info.world_size)
            raise
        teardown()


@contextlib.contextmanager
def caller_excepthook() -> Iterator[None]:
    """`sys.excepthook` as it was, after the block: starting a process group wraps it in
    torch's `[rankN]:` prefixer, which, never undone, wraps again on every `loom.fit` or
    `loom plan` in one process (`[rank0]: [rank0]: ...`)."""
    hook = sys.excepthook
    try:
        yield
    finally:
        sys.excepthook = hook
