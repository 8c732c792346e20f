"""--ft diloco: DiLoCo across the replica groups, on torchft's implementation.

Each group trains `--sync-every` (H) steps alone with the run's optimizer (the inner one),
sending nothing to the other groups. Then the groups average their pseudo-gradients (the
weights at the last sync minus their weights now), and an outer Nesterov SGD (the DiLoCo
paper's: lr 0.7, momentum 0.9) applies the average to the weights of the last sync, which
every group then holds. A sync torchft does not commit (a group failed during it) puts the
weights back to the last sync's. So groups exchange the weights once per H steps instead of
the gradients every step: about 1/H of --ft average's bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from loom.checkpoint.checkpointer import LoopState
from loom.config import JobConfig
from loom.parallel.mesh import ParallelDims
from loom.trainer.replica_groups import ReplicaGroupExecutor, local, logger
from loom.trainer.step import Accumulated, Batch, StepExecutor


class DiLoCoExecutor(ReplicaGroupExecutor):
    """The wrapped executor's step, alone in each group; torchft's DiLoCo syncs the groups
    from the inner optimizer's step hook every H steps."""

    def __init__(self, inner: StepExecutor, cfg: JobConfig, dims: ParallelDims):
        super().__init__(inner, cfg, dims)
        self.settings = cfg.parallel
        self.resumed: dict[str, torch.Tensor] = {}
        self.unsynced = 0
        """Steps trained since the last sync: they count as trained once a sync commits
        them, as discarded where the sync fails or heals this group (its work dropped)."""
        self.syncs = 0  # torchft's step (syncs committed) at the last sync
        self.healed = False  # whether this group took a peer's state since the last sync
        self.participants: int | None = None  # groups in the last sync's quorum

    def share_state(self, trainer: Any) -> LoopState:
        """Register the state a recovering group takes (the loop's and DiLoCo's own: the
        last sync's weights and the outer optimizer), and start syncing where the loop is
        (a resumed run: at the checkpoint's place in the sync cycle, with its last sync's
        weights and outer momentum), every group together (`gather`: a group whose
        checkpoint is older takes the state of the one furthest on, so that no group syncs
        at its own place in the cycle, alone where the others take longer than the join
        timeout to reach theirs, averaging pseudo-gradients taken from other weights ever
        after). A restarted group trains from its own state until the
        next sync's quorum heals it from a healthy one (its pseudo-gradient counts as none
        there), and then reads on from the healthy group's data position."""
        from torchft.local_sgd import DiLoCo  # the optional `ft` extra

        self.trainer = trainer
        self.manager.register_state_dict_fn("loom", self.load_state, self.state)
        p = self.settings
        self.outer = torch.optim.SGD(trainer.model.parameters(), lr=p.outer_lr,  # Nesterov
                                     momentum=p.outer_momentum,  # needs a momentum: 0 is
                                     nesterov=p.outer_momentum > 0)  # plain SGD
        self.diloco = DiLoCo(self.manager, [trainer.model], trainer.optimizer, self.outer,
                             sync_every=p.sync_every, backup_device=self.inner.device,
                             pin_memory=False)
        if self.resumed:
            self.apply_resumed()
        if not trainer.info.restarts:
            self.gather()  # every group; one resumed from an older checkpoint heals here
            self.healed = False  # nothing trained yet for the next sync to drop
        syncs, since = divmod(self.trainer.loop.step, p.sync_every)
        # torchft's step counts syncs; DiLoCo's `_local_step` (private, torchft 0.2.0) the
        # steps since the last one: both where the loop is, so every group syncs together
        self.manager.load_state_dict({"step": syncs,
                                      "batches_committed": self.manager.batches_committed()})
        self.diloco._local_step = since
        self.syncs = syncs
        self.diloco.__enter__()  # hooks on the inner optimizer's step, for the whole run
        return self.trainer.loop

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.trainer.model.named_parameters())

    def last_sync(self) -> dict[str, torch.Tensor]:
        """DiLoCo's copy of the weights at the last sync, this rank's shards by parameter
        name (`original_parameters` of its one fragment; torchft 0.2.0)."""
        return self.diloco._fragments[0].original_parameters

    def own_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps besides the inner optimizer: the last sync's weights and
        the outer optimizer's momentum, shaped (and sharded) as the parameters, so that a
        resumed run takes the next sync exactly as the run would have. Before the first
        sync the momentum is zeros, which SGD's first step treats as none."""
        state = {}
        for name, param in self.named_parameters().items():
            state[f"last_sync.{name}"] = like(param, self.last_sync()[name])
            held = self.outer.state.get(param, {}).get("momentum_buffer")
            state[f"outer_momentum.{name}"] = torch.zeros_like(param) if held is None else held
        return state

    def resumed_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        self.resumed = {f"{kind}.{name}": torch.zeros_like(param)
                        for name, param in model.named_parameters()
                        for kind in ("last_sync", "outer_momentum")}
        return self.resumed

    @torch.no_grad()
    def apply_resumed(self) -> None:
        """A checkpoint's DiLoCo state into torchft's DiLoCo (`resumed_state`'s tensors,
        which the checkpoint loaded)."""
        for name, param in self.named_parameters().items():
            self.last_sync()[name].copy_(local(self.resumed[f"last_sync.{name}"]))
            if self.outer.defaults["momentum"]:
                self.outer.state[param]["momentum_buffer"] = \
                    self.resumed[f"outer_momentum.{name}"]
        self.resumed = {}

    def forward_backward(self, micro_batches: list[Batch],
                         forward_done: Callable[[], None]) -> Accumulated:
        """This group's own step: its batch is its share of the job's (`trained`)."""
        done = self.inner.forward_backward(micro_batches, forward_done)
        self.unsynced += 1
        share = 1.0 / self.dims.replica_groups
        metrics = {**done.metrics, "train/tokens": round(self.tokens * share)}
        return replace(done, metrics=metrics, trained=share)

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.healed = True

    def after_update(self) -> dict[str, float]:
        """After the inner optimizer's step, where DiLoCo syncs: the steps since the last
        sync are trained if this sync committed them, discarded if it failed or healed
        this group; the groups the last sync averaged over (`ft/participants`, from the
        first sync on: between syncs no group hears of another), and the bytes sent so far,
        so that a sync's are in its own row."""
        if self.diloco._local_step == 0:  # a sync ran in this step (torchft 0.2.0's count)
            syncs = self.manager.current_step()
            kept = syncs > self.syncs and not self.healed
            self.trained += self.unsynced if kept else 0
            self.discarded += 0 if kept else self.unsynced
            self.unsynced, self.syncs, self.healed = 0, syncs, False
            self.participants = self.manager.num_participants()
            if self.participants < self.dims.replica_groups:
                logger.warning(
                    "replica group %d synced with %d of %d groups: the others failed, or "
                    "reached their sync later than the lighthouse's join timeout "
                    "(docs/faults.md, DiLoCo)", self.group, self.participants,
                    self.dims.replica_groups)
        rows = {"ft/bytes_sent": float(self.bytes_sent),
                "ft/recoveries": float(len(self.recoveries))}
        if self.participants is not None:
            rows["ft/participants"] = float(self.participants)
        return rows

    def summary(self) -> dict[str, Any]:
        """As `--ft average`'s, the steps since the last sync counted as trained (they are
        in this group's weights, though in no other group's)."""
        done = super().summary()
        done["ft"]["steps_trained"] += self.unsynced
        return done


def like(param: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """`shard` (this rank's part of `param`) as `param` is: a DTensor of its mesh and
    placements where `param` is one, so a checkpoint stores it as the parameter."""
    if isinstance(param, DTensor):
        return DTensor.from_local(shard, param.device_mesh, param.placements,
                                  shape=param.shape, stride=param.stride())
    return shard
