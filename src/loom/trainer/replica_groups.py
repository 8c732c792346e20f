"""Fault-tolerant replica groups (--ft-replica-groups N, docs/faults.md) on torchft.

The job is N groups, each its own launch (`loom launch --ft-replica-groups N` starts them and
torchft's lighthouse). Inside a group the step runs as without the flag; this executor wraps
it: before the forward it joins torchft's quorum (the groups present this step), after the
backward it averages the gradients (each rank's local shards) over the groups in the quorum,
weighted by their valid tokens as one global batch's mean, and the optimizer steps only
when torchft's Manager commits the step. A step it discards trains nothing and counts no
tokens; its data is not drawn again (the row's `ft/committed` is 0).

torchft is an optional extra: it is imported here only when the flag is given.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from loom.checkpoint.checkpointer import LoopState
from loom.config import JobConfig
from loom.models.registry import spec_of
from loom.parallel.mesh import ParallelDims
from loom.trainer.ft_transport import checked_transport
from loom.trainer.step import Accumulated, Batch, StepExecutor

logger = logging.getLogger("loom")

TIMEOUT_S = 30.0
"""A collective across the groups, the commit vote and a live recovery's transfer: a group
that lost a rank is noticed within this, and the others go on without it."""
QUORUM_TIMEOUT_S = 60.0
"""Waiting for the lighthouse to form the step's quorum (the groups that are alive); longer
where the lighthouse's join timeout is (`--ft-join-timeout-s` of loom launch), which it may
wait out before it answers."""
JOIN_ATTEMPTS = 10
"""Join steps a restarted group tries before it gives up (its launch may restart it)."""


NOISE = ("Unable to reset NCCL flight recorder",)
"""torchft's warnings that say nothing on a CPU job (no NCCL), at every quorum change."""


def quiet(record: logging.LogRecord) -> bool:
    """torchft's manager lines, one each: without the noise above, and without the
    traceback of a peer's lost connection (the line names the error)."""
    record.exc_info = record.exc_text = None
    return not any(n in record.getMessage() for n in NOISE)


class ReplicaGroupExecutor:
    """A step executor whose forward and backward is the wrapped one's, averaged over the
    replica groups in torchft's quorum; every other attribute is the wrapped executor's."""

    votes = True
    """The update is decided on the host (torchft's commit vote), never masked on the
    device (`Trainer.masked_update`)."""

    def __init__(self, inner: StepExecutor, cfg: JobConfig, dims: ParallelDims):
        from torchft import Manager  # the optional `ft` extra: only under the flag

        logging.getLogger("torchft.manager").addFilter(quiet)
        # torchft reads a received state from a bytes buffer (torch 2.13's streaming load)
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        self.inner, self.dims = inner, dims
        self.group = dims.replica_group
        self.join_timeout_s = cfg.parallel.ft_join_timeout_s
        self.tokens = dims.global_batch_size(cfg.train.batch_size) \
            * cfg.train.grad_accum_steps * cfg.data.seq_len
        self.trained = self.discarded = 0
        self.contributes = 1.0  # 0.0 on a join step: a restarted group adds no gradient
        self.drawn = 0  # the groups that added a batch to the last step
        self.recoveries: list[dict[str, int]] = []  # summary.json's record of each
        self.statistics = token_statistics(inner.parts)  # the families' hooks' buffers
        self.committed = False  # whether torchft committed the last step
        rank = dist.get_rank()
        if rank != 0:  # after rank 0 has published this attempt's manager address (the
            dist.barrier()  # store outlives a restart and holds the last attempt's)
        self.store, meet = own_store()
        transport = checked_transport(timedelta(seconds=TIMEOUT_S), self.state_limit)
        self.manager = Manager(
            pg=process_group(inner.device), min_replica_size=1, **meet,
            checkpoint_transport=transport,
            load_state_dict=None, state_dict=None, use_async_quorum=False, init_sync=False,
            rank=rank, world_size=dist.get_world_size(),
            replica_id=f"loom_group_{self.group}", lighthouse_addr=cfg.parallel.ft_lighthouse,
            timeout=timedelta(seconds=TIMEOUT_S),
            quorum_timeout=timedelta(seconds=max(QUORUM_TIMEOUT_S,  # past the lighthouse's
                                                 self.join_timeout_s + TIMEOUT_S)),
            connect_timeout=timedelta(seconds=TIMEOUT_S))
        if rank == 0:
            dist.barrier()
        self.bytes_sent = 0
        """Bytes this rank handed to the allreduce across the groups (what the network
        carries between groups scales with it), counted as it goes."""
        allreduce = self.manager.allreduce

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            held = local(tensor)
            self.bytes_sent += held.numel() * held.element_size()
            return allreduce(tensor, *args, **kwargs)

        self.manager.allreduce = counted  # torchft's DiLoCo calls it through the manager

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def share_state(self, trainer: Any) -> LoopState:
        """Serve this group's state to a recovering peer; in a restarted or resumed group,
        first take the state of any group that is further on (`join`): a group whose newest
        checkpoint is older than another's, or that starts afresh while the others train,
        recovers live before it reads any data. Returns the loop state to train on from."""
        self.trainer = trainer
        self.manager.register_state_dict_fn("loom", self.load_state, self.state)
        if trainer.info.restarts:
            return self.join()
        self.gather()
        return self.trainer.loop

    def gather(self) -> None:
        """A job's groups start together. torchft's lighthouse forms a quorum as soon as
        every group it has heard from has joined, so a group whose ranks start a few
        seconds late (measured here: 6 s, the first of two runs in a test) finds the
        others already training alone, and a fresh job is two runs until it catches up.
        So each group meets the lighthouse until every group is in one quorum, up to the
        join timeout (then it trains with those present, and says so). torchft's step is
        the loop's: in a resumed job a group whose checkpoint is older takes the state of
        the one furthest on here, before it reads any data."""
        deadline = time.monotonic() + self.join_timeout_s
        while True:
            self.keep_step()
            self.manager.start_quorum()  # a group behind loads the state of one further on
            self.manager.should_commit()  # closes the quorum's step; nothing is applied
            present = self.manager.num_participants()
            if present >= self.dims.replica_groups:
                return
            if time.monotonic() > deadline:
                logger.warning("replica group %d starts with %d of %d groups: the others did "
                               "not join within the join timeout (%g s)", self.group,
                               present, self.dims.replica_groups, self.join_timeout_s)
                return
            time.sleep(0.1)  # the others' managers are still starting

    def keep_step(self) -> None:
        """torchft's step is the loop's (steps taken, discarded ones too), so that the
        quorum heals exactly the groups that are behind: every group present holds the same
        state at the same step, and a group's checkpoint was saved at one of those."""
        self.manager.load_state_dict({"step": self.trainer.loop.step,
                                      "batches_committed": self.manager.batches_committed()})

    def state(self) -> dict[str, Any]:
        """This rank's part of the group's state (local shards: the peer's rank of the same
        dp coordinate holds the same shards), the loop's position and the schedule."""
        t = self.trainer
        params = [p for g in t.optimizer.param_groups for p in g["params"]]
        return {"model": {n: local(v) for n, v in t.model.state_dict().items()},
                "optim": [{k: local(v) for k, v in t.optimizer.state[p].items()}
                          for p in params],
                "scheduler": t.scheduler.state_dict(), "loop": vars(t.loop)}

    def state_limit(self) -> int:
        """The most bytes a peer's state may take on the wire: this rank's parameters and
        optimizer state four times over (the peer's have the same shapes; DiLoCo adds the
        last sync's weights and the outer momentum) and 64 MiB for the rest."""
        t = self.trainer
        held = [local(p) for p in t.model.parameters()]
        held += [local(v) for s in t.optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)]
        return 4 * sum(v.numel() * v.element_size() for v in held) + (64 << 20)

    @torch.no_grad()
    def load_state(self, state: dict[str, Any]) -> None:
        t = self.trainer
        for name, value in t.model.state_dict().items():
            local(value).copy_(state["model"][name])
        params = [p for g in t.optimizer.param_groups for p in g["params"]]
        for p, saved in zip(params, state["optim"], strict=True):
            held = t.optimizer.state[p]
            for key, value in saved.items():
                if key in held:
                    local(held[key]).copy_(value)
                elif isinstance(p, DTensor) and value.dim():
                    held[key] = DTensor.from_local(value.clone(), p.device_mesh, p.placements)
                else:
                    held[key] = value.clone()
        t.scheduler.load_state_dict(state["scheduler"])
        t.loop = LoopState(**state["loop"])
        self.recovered = t.loop.step
        self.recoveries.append({"step": t.loop.step, "samples_seen": t.loop.samples_seen})
        logger.info("recovered live from a healthy replica group: step %d, %d samples "
                    "drawn", t.loop.step, t.loop.samples_seen)

    def join(self) -> LoopState:
        """A restarted or resumed group's first step: torchft's quorum hands it the state
        of a group further on, if any (`load_state`); it adds no gradient (zero shards and
        no tokens, so the average is the others' alone), then applies the step's average as
        every group does, and trains on from the next step's data. Where no group added a
        batch (the whole job resumed: every group joins) the step is no step: nothing is
        applied and no data is passed over. A join step torchft discards (a group failed
        in it) is tried again: the others have moved on by that step, and the next quorum
        hands this group their state once more."""
        t = self.trainer
        self.recovered = None
        empty = Accumulated(torch.zeros((), device=self.inner.device),
                            torch.zeros((), dtype=torch.int64, device=self.inner.device))
        for _ in range(JOIN_ATTEMPTS):
            self.keep_step()
            self.manager.start_quorum()
            for p in self.inner.parameters():
                p.grad = torch.zeros_like(p)
            self.contributes = 0.0
            try:
                done = self.average(empty)
            finally:
                self.contributes = 1.0
            if self.committed:
                break
            t.optimizer.zero_grad(set_to_none=True)
        else:
            raise RuntimeError(f"replica group {self.group} could not join: torchft "
                               f"discarded {JOIN_ATTEMPTS} join steps in a row")
        if self.recovered is None and t.info.restarts:
            logger.warning("replica group %d restarted but no group had a later step: it "
                           "trains on from its own state (step %d)", self.group, t.loop.step)
        if self.drawn:  # the others took a step: so does this group, hooks included
            t.advance(t.update(done).trained)
        else:
            t.optimizer.zero_grad(set_to_none=True)
        return t.loop

    def forward_backward(self, micro_batches: list[Batch],
                         forward_done: Callable[[], None]) -> Accumulated:
        self.keep_step()
        self.manager.start_quorum()  # a recovering group loads a peer's state here
        done = self.inner.forward_backward(micro_batches, forward_done)
        return self.average(done)

    @torch.no_grad()
    def average(self, done: Accumulated) -> Accumulated:
        """Sum each group's gradient shards weighted by its valid tokens, and the valid
        tokens and loss shares themselves, over the groups in the quorum; then vote."""
        grads = [p.grad for p in self.inner.parameters() if p.grad is not None]
        shards = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        valid = done.valid.double()
        statistics = self.statistics  # summed as they are, unweighted
        flat = torch.cat([*(s.reshape(-1).float() * valid.float() for s in shards),
                          *(s.reshape(-1).float() for s in statistics)])
        counts = torch.stack([valid, done.loss_sum.double(),
                              torch.tensor(self.contributes, dtype=torch.float64)])
        summing = dist.ReduceOp.SUM
        for work in [self.manager.allreduce(t, reduce_op=summing) for t in (flat, counts)]:
            work.wait()
        total = counts[0].clamp(min=1.0)
        offset = 0
        for s in shards:  # in place: the DTensor gradients hold these local shards
            s.copy_((flat[offset:offset + s.numel()] / total.float()).view_as(s))
            offset += s.numel()
        for s in statistics:
            s.copy_(flat[offset:offset + s.numel()].view_as(s))
            offset += s.numel()
        participants = self.manager.num_participants()
        committed = self.manager.should_commit()  # the vote: every group's collectives passed
        self.committed = committed
        trained = round(float(counts[2]))  # the groups that added their batch
        self.drawn = trained
        share = trained / self.dims.replica_groups if committed and trained else 0.0
        self.trained += committed and bool(self.contributes)
        self.discarded += not committed
        if not committed:
            logger.warning("step discarded by torchft (a replica group failed mid-step); "
                           "%d group(s) in the quorum", participants)
        metrics = {**done.metrics, "ft/participants": float(participants),
                   "ft/committed": float(committed), "train/tokens": round(self.tokens * share),
                   "ft/bytes_sent": float(self.bytes_sent),
                   "ft/recoveries": float(len(self.recoveries))}
        return replace(done, loss_sum=counts[1].to(done.loss_sum.dtype),
                       valid=counts[0].round().to(done.valid.dtype), metrics=metrics,
                       trained=share)

    def summary(self) -> dict[str, Any]:
        """summary.json's account of this group: the steps it trained and those discarded,
        and each live recovery (the loop's step and data position it took)."""
        return {"ft": {"group": self.group, "groups": self.dims.replica_groups,
                       "steps_trained": self.trained, "steps_discarded": self.discarded,
                       "bytes_sent": self.bytes_sent, "recoveries": self.recoveries}}


def token_statistics(parts: list[nn.Module]) -> list[torch.Tensor]:
    """The buffers the families' step hooks sum over the ranks holding different tokens
    (`SpecHook.token_sums`): summed across the groups with the gradients, so that each
    hook's own sum, within a group, is the whole job's (MoE's expert-bias update)."""
    found = []
    for part in parts:
        spec = spec_of(part)
        names = {n for hook in (spec.hooks if spec else ()) for n in hook.token_sums}
        found += [b for name, b in part.named_buffers() if name.rsplit(".", 1)[-1] in names]
    return found


def own_store() -> tuple[dist.TCPStore | None, dict[str, Any]]:
    """torchft's Manager meets its group's ranks in a TCP store, by default at MASTER_ADDR
    and MASTER_PORT: torchrun's agent serves one there, and so does rank 0 of a larger
    group (`loom.runtime.distributed.job_store`); a group of one process under srun or
    mpiexec has none (its process group needs no store), so it serves its own, on a free
    port. Returns the store (kept for the run) and the Manager's arguments."""
    if dist.get_world_size() > 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None, {}
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    return store, {"store_addr": "localhost", "store_port": store.port}


def local(value: Any) -> Any:
    """A DTensor's local shard (the storage this rank holds), anything else as it is."""
    return value.to_local() if isinstance(value, DTensor) else value


def process_group(device: torch.device) -> Any:
    """torchft's reconfigurable process group across the groups: gloo on CPU, NCCL else."""
    from torchft import ProcessGroupGloo, ProcessGroupNCCL

    timeout = timedelta(seconds=TIMEOUT_S)
    return ProcessGroupGloo(timeout=timeout) if device.type == "cpu" \
        else ProcessGroupNCCL(timeout=timeout)
