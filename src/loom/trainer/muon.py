"""Muon for the hidden weight matrices and AdamW for every other parameter, as one optimizer:
one state dict for the checkpoint, one set of groups for the learning-rate schedule.

Each Muon step is torch.optim.Muon's (torch 2.11-2.15): the momentum `lerp`, Nesterov's
lookahead, torch's own Newton-Schulz (`loom.compat.newton_schulz`, in bfloat16 as torch
does) and learning-rate adjustment, decoupled weight decay. Where loom differs: the momentum
and the update run on each rank's shard, and the orthogonalization on whole matrices wherever
the layout put their pieces (`loom.parallel.orthogonalize`); a 3-D expert weight is a stack
of matrices, each orthogonalized and its learning rate adjusted on its own shape; and each
parameter keeps a `step` count beside its one momentum buffer, as AdamW's state does (the
loop reads the update count from it after a resume); `--muon-ns-dtype fp32` runs torch's
iteration in float32 (`newton_schulz_fp32`), for runs that must agree across layouts.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
from torch.distributed.tensor import DTensor

from loom.compat import muon_adjust_lr, newton_schulz
from loom.parallel.orthogonalize import orthogonalize


def newton_schulz_fp32(grad: torch.Tensor, ns_coefficients: tuple[float, float, float],
                       ns_steps: int, eps: float) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz (`loom.compat.newton_schulz`) in float32
    instead of bfloat16: the one place loom's iteration is its own (--muon-ns-dtype fp32),
    so that a layout's summation order stays an fp32 difference, not a bfloat16 one."""
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.float().T if tall else grad.float()
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


MUON = "muon"
"""The `kind` of a Muon group; AdamW's groups carry none."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class MuonWithAdamW(torch.optim.Optimizer):
    """`muon` parameters (2-D matrices or 3-D stacks of them) take Muon, the rest `adamw`,
    a torch AdamW sharing this optimizer's groups and state."""

    def __init__(self, muon: Iterable[torch.Tensor], adamw: torch.optim.AdamW | None, *,
                 lr: float, ns_dtype: str, weight_decay: float, momentum: float, nesterov: bool,
                 ns_coefficients: tuple[float, float, float], ns_steps: int,
                 adjust_lr_fn: str, eps: float = 1e-7):
        group = dict(params=list(muon), kind=MUON, lr=lr, weight_decay=weight_decay,
                     momentum=momentum, nesterov=nesterov, ns_coefficients=ns_coefficients,
                     ns_steps=ns_steps, eps=eps, adjust_lr_fn=adjust_lr_fn,
                     ns_dtype=ns_dtype)
        groups = [*(adamw.param_groups if adamw else ()), group]
        super().__init__(groups, {})
        # "fused" as fused AdamW means it: the step takes `found_inf` and skips on the device;
        # set after the groups are made, so they (and checkpoints) keep Muon's keys only
        self.defaults["fused"] = adamw is None or bool(adamw.defaults.get("fused"))
        self.adamw = adamw

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        """One update; where the trainer set `found_inf` (a device scalar, 1 skips), both
        parts skip a non-finite step on the device, so no step reads the device."""
        found_inf = getattr(self, "found_inf", None)
        if self.adamw is not None:  # load_state_dict replaces groups and state: share them
            self.adamw.param_groups = [g for g in self.param_groups if g.get("kind") != MUON]
            self.adamw.state = self.state
            if found_inf is not None:
                self.adamw.found_inf = found_inf
            try:
                self.adamw.step()
            finally:
                self.adamw.__dict__.pop("found_inf", None)
        keep = None if found_inf is None else found_inf == 0
        for group in self.param_groups:
            if group.get("kind") == MUON:
                self._muon_step(group, keep)

    def _muon_step(self, group: dict, keep: torch.Tensor | None) -> None:
        """`keep` (a device bool, or None: always) masks every write: a skipped step leaves
        weights, momentum and the update count as they were, whatever its gradients hold.
        Masked, a parameter costs one operator more (the gradient's `where`: the skipped
        step's momentum moves towards itself), the group one (its updates scaled by 0)."""
        params = [p for p in group["params"] if p.grad is not None]
        momentum, updates = group["momentum"], []
        lr, decay = group["lr"], group["weight_decay"]
        counted, decayed = 1.0, 1 - lr * decay
        if keep is not None:  # once per group: device scalars
            counted = keep.float()
            decayed = torch.where(keep, 1 - lr * decay, 1.0)  # the plain step's one rounding
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
                state["step"] = torch.zeros((), device=p.device)  # where `keep` is
            if state["step"].device != p.device:  # a checkpoint's host count: moved once
                state["step"] = state["step"].to(p.device)
            state["step"] += counted
            grad, buf = _local(p.grad), _local(state["momentum_buffer"])
            if keep is not None:  # a skipped step's gradient may be NaN: never read
                grad = torch.where(keep, grad, buf)
            buf.lerp_(grad, 1 - momentum)  # as torch.optim.Muon, on this rank's shard
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            if isinstance(p.grad, DTensor):
                update = DTensor.from_local(update, p.grad.device_mesh, p.grad.placements,
                                            run_check=False, shape=p.grad.shape,
                                            stride=p.grad.stride())
            updates.append(update)
        iteration = newton_schulz if group["ns_dtype"] == "bf16" else newton_schulz_fp32
        ns = partial(iteration, ns_coefficients=group["ns_coefficients"],
                     ns_steps=group["ns_steps"], eps=group["eps"])
        orthogonal = list(orthogonalize(updates, ns))
        if keep is not None:  # a skipped step's update is 0: one operator for the group
            torch._foreach_mul_(orthogonal, counted)  # private, as optimizers use it: 2.11-2.15
        for p, update in zip(params, orthogonal, strict=True):
            local = _local(p)
            local.mul_(decayed)
            local.add_(update, alpha=-muon_adjust_lr(lr, group["adjust_lr_fn"], p.shape[-2:]))
