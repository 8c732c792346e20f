"""Distributed checkpoints: complete or absent, never half-written, never unpickling code.

A save writes `checkpoints/.step-N.tmp/` on every rank, seals it with a manifest of
checksums and then rank 0 renames it to `step-N`, so a job killed mid-save leaves the
previous checkpoint as the latest. Model tensors and optimizer state tensors go through
torch.distributed.checkpoint (resharded on load to any mesh) in loom's pickle-free layout,
`loom.checkpoint.format`; loop state, scheduler state, optimizer hyperparameters and RNG
states are JSON. What loading trusts is in `loom.checkpoint.trust`.
"""

from __future__ import annotations

import errno
import json
import logging
import random
import re
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from loom.checkpoint.format import METADATA, TensorReader, TensorWriter, load_metadata
from loom.checkpoint.layout import checkpoint_dir, complete_checkpoints, prunable, step_of
from loom.checkpoint.trust import (
    HashingFileSystem,
    UnusableCheckpoint,
    file_record,
    read_json,
    write_manifest,
)
from loom.errors import CheckpointWriteError
from loom.parallel.init import clean_name

logger = logging.getLogger("loom")


@dataclass
class LoopState:
    """Where training stands; enough to continue with the next unseen batch."""

    step: int = 0
    tokens_seen: int = 0
    samples_seen: int = 0
    """Global samples consumed: the data position, independent of the dp layout."""


def _rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def _groups_to_json(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]


def _groups_from_json(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """JSON has no tuples: hyperparameters such as AdamW's betas come back as tuples."""
    return [{k: v if k == "params" or not isinstance(v, list) else tuple(v)
             for k, v in g.items()} for g in groups]


def every_rank_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The optimizer groups with each group's parameter names joined over all ranks
    (collective). loop.json is rank 0's, and a pipeline stage lists only its own
    parameters: a rank that resumes other stages must still find its parameters there, or
    its groups come back without their hyperparameters."""
    shared: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shared, [g["params"] for g in groups])
    return [{**g, "params": list(dict.fromkeys(n for names in shared for n in names[i]))}
            for i, g in enumerate(groups)]


def renamed(model_sd: dict[str, Any], optim_sd: dict[str, Any], rename: Callable[[str], str]
            ) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP's model and optimizer state dicts with every parameter name passed through
    `rename`: checkpoints hold the plain model's names (`clean_name`), whichever wrapper ran."""
    groups = [{**g, "params": [rename(n) for n in g["params"]]} for g in optim_sd["param_groups"]]
    return ({rename(k): v for k, v in model_sd.items()},
            {"state": {rename(k): v for k, v in optim_sd["state"].items()}, "param_groups": groups})


def plain_namer(model: nn.Module) -> Callable[[str], str]:
    """Own name -> the plain model's name. A rank with several pipeline stages holds them
    in one `nn.ModuleList` (`loom.trainer.step.parts_module`), which prefixes each name with the
    stage's position on this rank (`0.layers.1.w`): that prefix goes too. Every stage is the
    whole model with the other layers removed, so the rest is the whole model's name, unique
    across stages, and DCP reshards to any other pipeline layout."""
    if isinstance(model, nn.ModuleList):
        return lambda name: clean_name(name.split(".", 1)[1])
    return clean_name


def plain_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer
                     ) -> tuple[dict[str, Any], dict[str, Any], Callable[[str], str]]:
    """The model's and optimizer's state dicts under plain names, and the way back to the
    model's own names (SimpleFSDP's parametrizations store `w` as
    `parametrizations.w.original`; several stages per rank add their position)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    plain = plain_namer(model)
    own = {plain(name): name for name in model_sd}
    if len(own) != len(model_sd):
        raise ValueError("two of this rank's model parts share a parameter name")
    return (*renamed(model_sd, optim_sd, plain), lambda name: own.get(name, name))


def saved_model_state(model: nn.Module, model_sd: dict[str, Any]) -> dict[str, Any]:
    """The model state a checkpoint holds: all of it but frozen parameters (a LoRA run's
    base), which the run's source holds and every reader takes from there."""
    plain = plain_namer(model)
    frozen = {plain(n) for n, p in model.named_parameters() if not p.requires_grad}
    return {name: value for name, value in model_sd.items() if name not in frozen}


def _local_bytes(state: dict[str, Any]) -> int:
    total = 0
    for value in state.values():
        if isinstance(value, dict):
            total += _local_bytes(value)
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    return total


def storage_writer(path: Path) -> TensorWriter:
    """loom's DCP writer (raw tensors, JSON metadata), hashing files as it writes them (a
    seam for tests that simulate a full disk)."""
    writer = TensorWriter(path)
    writer.fs = HashingFileSystem()
    return writer


def _describe(error: BaseException) -> tuple[str, bool]:
    """One line for a failed save, and whether the disk was full."""
    if isinstance(error, CheckpointException):
        error = next(iter(error.failures.values()))[0]
    full = isinstance(error, OSError) and error.errno == errno.ENOSPC
    return f"{type(error).__name__}: {error}", full


class Checkpointer:
    """Saves every `interval` steps (and at the end), keeps this run's newest `keep`."""

    def __init__(self, outdir: Path, interval: int, keep: int, async_save: bool, rank: int,
                 run_id: str):
        self.root = checkpoint_dir(outdir)
        self.interval, self.keep, self.async_save, self.rank = interval, keep, async_save, rank
        self.run_id = run_id
        self._pending: tuple[Future, Path, Path, dict[str, Any]] | None = None
        self._needed = 0
        self.last_save_seconds = 0.0

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def due(self, step: int) -> bool:
        return self.enabled and step % self.interval == 0

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             extra: dict[str, Any], own: dict[str, torch.Tensor] | None = None) -> None:
        """Write step-N through a temporary folder; with async, the rename happens when the
        next save starts or at `finish()`. `own`: the step executor's tensors
        (`StepExecutor.own_state`), stored under `executor.`."""
        self.finish()
        final, tmp = self.root / f"step-{step}", self.root / f".step-{step}.tmp"
        model_sd, optim_sd, _ = plain_state_dict(model, optimizer)
        state = {"model": saved_model_state(model, model_sd),
                 "optim": {"state": optim_sd["state"]}, **({"executor": own} if own else {})}
        loop = {**extra, "param_groups": _groups_to_json(
            every_rank_groups(optim_sd["param_groups"]))}
        error = None
        if self.rank == 0:
            error = self._attempt(lambda: (shutil.rmtree(tmp, ignore_errors=True),
                                           tmp.mkdir(parents=True)))
        self._agree(tmp, error, needed=_local_bytes(state))
        error = self._attempt(lambda: self._write_json(tmp, loop))
        self._agree(tmp, error)
        writer = storage_writer(tmp)
        written = getattr(writer.fs, "records", {})
        if self.async_save:
            self._pending = (dcp.async_save(state, storage_writer=writer), tmp, final, written)
            return
        try:
            dcp.save(state, storage_writer=writer)
        except (Exception, CheckpointException) as e:  # DCP raises on every rank together
            self._fail(tmp, e)
        self._commit(tmp, final, step, written)

    def _write_json(self, tmp: Path, loop: dict[str, Any]) -> None:
        (tmp / f"rng-{self.rank}.json").write_text(json.dumps(_rng_state()))
        if self.rank == 0:
            (tmp / "loop.json").write_text(json.dumps(loop, indent=2))

    @staticmethod
    def _attempt(action: Any) -> BaseException | None:
        try:
            action()
        except OSError as e:
            return e
        return None

    def _agree(self, tmp: Path, error: BaseException | None, needed: int | None = None,
               records: dict[str, Any] | None = None) -> dict[str, Any]:
        """Share each rank's outcome, bytes to write and file records; if any rank failed,
        all raise the same error. Returns every rank's file records."""
        shared: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(shared, (_describe(error) if error else None, needed, records))
        if needed is not None:
            self._needed = sum(n for _, n, _ in shared)
        failed = [outcome for outcome, _, _ in shared if outcome is not None]
        if failed:
            self._raise(tmp, *failed[0])
        return {name: record for *_, found in shared for name, record in (found or {}).items()}

    def _fail(self, tmp: Path, error: BaseException) -> None:
        self._raise(tmp, *_describe(error))

    def _raise(self, tmp: Path, message: str, disk_full: bool) -> None:
        """Remove the partial save, keep the previous checkpoint, say so in one line."""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        done = complete_checkpoints(self.root.parent)
        kept = f"; {done[-1]} is intact" if done else ""
        if disk_full:
            free = shutil.disk_usage(self.root if self.root.exists() else "/").free
            raise CheckpointWriteError(
                f"disk full writing checkpoint {tmp}: it needs about {self._needed:,} bytes, "
                f"{free:,} free{kept}")
        raise CheckpointWriteError(f"checkpoint save to {tmp} failed: {message}{kept}")

    def finish(self) -> None:
        """Wait for an asynchronous save and publish it."""
        if self._pending is not None:
            future, tmp, final, written = self._pending
            self._pending = None
            try:
                future.result()
            except (Exception, CheckpointException) as e:
                self._fail(tmp, e)
            self._commit(tmp, final, step_of(final), written)

    def _own_files(self, tmp: Path) -> list[Path]:
        """What this rank wrote (DCP names rank r's data files `__r_*.distcp`); rank 0 also
        wrote the metadata and loop state."""
        own = re.compile(rf"^(__{self.rank}_\d+\.distcp|rng-{self.rank}\.json)$")
        shared = (METADATA, "loop.json") if self.rank == 0 else ()
        return [p for p in tmp.iterdir() if own.match(p.name) or p.name in shared]

    def _commit(self, tmp: Path, final: Path, step: int, written: dict[str, Any]) -> None:
        """Every rank shares the hashes of its own files (data files were hashed while
        written); rank 0 seals, publishes and prunes."""
        records: dict[str, Any] = {}
        error = self._attempt(lambda: records.update(
            {p.name: written.get(p.name) or file_record(p) for p in self._own_files(tmp)}))
        records = self._agree(tmp, error, records=records)
        if self.rank == 0:
            error = self._attempt(lambda: self._publish(tmp, final, step, records))
        self._agree(tmp, error)
        if self.rank == 0:
            logger.info("checkpoint saved: %s", final)

    def _publish(self, tmp: Path, final: Path, step: int, records: dict[str, Any]) -> None:
        write_manifest(tmp, records, run_id=self.run_id, step=step)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in prunable(complete_checkpoints(self.root.parent), self.run_id, self.keep,
                            final):
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)

    @staticmethod
    def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int,
             saved: dict[str, Any], own: dict[str, torch.Tensor] | None = None) -> None:
        """Load a verified checkpoint's model and optimizer (resharded to this mesh) and this
        rank's RNG state; `saved` is its loop.json. `own`: the step executor's tensors
        (`StepExecutor.resumed_state`), loaded in place."""
        model_sd, optim_sd, own_name = plain_state_dict(model, optimizer)
        # Group counts, not parameter names: a pipeline stage's groups list its own parameters.
        kinds = [[g.get("kind", "adamw") for g in groups]
                 for groups in (saved["param_groups"], optim_sd["param_groups"])]
        if kinds[0] != kinds[1]:  # --optimizer muon holds two kinds of groups, AdamW one
            raise UnusableCheckpoint(f"checkpoint {path}: its optimizer groups are "
                                     f"{', '.join(kinds[0])}, this run's {', '.join(kinds[1])} "
                                     "(resume with the checkpoint's --optimizer)")
        state = {"model": saved_model_state(model, model_sd),
                 "optim": {"state": optim_sd["state"]}, **({"executor": own} if own else {})}
        if own and not any(k.startswith("executor.")
                           for k in load_metadata(path).state_dict_metadata):
            raise UnusableCheckpoint(f"checkpoint {path} holds no state of this run's step "
                                     f"({', '.join(sorted(own)[:2])}, ...): it was saved by "
                                     "another --ft")
        try:
            dcp.load(state, storage_reader=TensorReader(path))
        except CheckpointException as e:  # a BaseException: escapes `except Exception`
            raise UnusableCheckpoint(f"checkpoint {path} cannot be loaded: "
                                     f"{_describe(e)[0]}") from None
        model_sd, optim_sd = renamed({**model_sd, **state["model"]}, {
            "state": state["optim"]["state"],
            "param_groups": _groups_from_json(saved["param_groups"])}, own_name)
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        if (path / f"rng-{rank}.json").is_file():
            _set_rng_state(read_json(path, f"rng-{rank}.json"))
