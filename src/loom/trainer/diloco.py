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

from loom.checkpoint.checkpointer import LoopState
from loom.config import JobConfig
from loom.parallel.mesh import ParallelDims
from loom.trainer.replica_groups import ReplicaGroupExecutor
from loom.trainer.step import Accumulated, Batch, StepExecutor


class DiLoCoExecutor(ReplicaGroupExecutor):
    """The wrapped executor's step, alone in each group; torchft's DiLoCo syncs the groups
    from the inner optimizer's step hook every H steps."""

    def __init__(self, inner: StepExecutor, cfg: JobConfig, dims: ParallelDims):
        super().__init__(inner, cfg, dims)
        self.settings = cfg.parallel

    def share_state(self, trainer: Any) -> LoopState:
        """Register the state a recovering group takes (the loop's and DiLoCo's own: the
        last sync's weights and the outer optimizer), and start syncing. A restarted group
        trains from its own state until the next sync's quorum heals it from a healthy one
        (its pseudo-gradient counts as none there)."""
        from torchft.local_sgd import DiLoCo  # the optional `ft` extra

        self.trainer = trainer
        self.manager.register_state_dict_fn("loom", self.load_state, self.state)
        p = self.settings
        outer = torch.optim.SGD(trainer.model.parameters(), lr=p.outer_lr,  # Nesterov needs
                                momentum=p.outer_momentum,  # a momentum: 0 is plain SGD
                                nesterov=p.outer_momentum > 0)
        self.diloco = DiLoCo(self.manager, [trainer.model], trainer.optimizer, outer,
                             sync_every=p.sync_every, backup_device=self.inner.device,
                             pin_memory=False)
        self.diloco.__enter__()  # hooks on the inner optimizer's step, for the whole run
        return trainer.loop

    def forward_backward(self, micro_batches: list[Batch],
                         forward_done: Callable[[], None]) -> Accumulated:
        """This group's own step: its batch is its share of the job's (`trained`)."""
        done = self.inner.forward_backward(micro_batches, forward_done)
        self.trained += 1
        share = 1.0 / self.dims.replica_groups
        metrics = {**done.metrics, "ft/bytes_sent": float(self.bytes_sent),
                   "train/tokens": round(self.tokens * share)}
        return replace(done, metrics=metrics, trained=share)
