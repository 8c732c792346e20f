"""`loom train`: config -> runtime -> mesh -> data -> model -> parallelize -> optimizer -> loop."""

from __future__ import annotations

import itertools
import logging
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loom.checkpoint.checkpointer import Checkpointer, LoopState
from loom.checkpoint.resume import (
    ResumePoint,
    architecture,
    new_run_id,
    rescale_lr,
    resume_on_restart,
    run_settings,
    set_aside_later,
)
from loom.config import ConfigError, JobConfig
from loom.config.resolve import resolve
from loom.data.loaders import build_dataloader, end_of_text, on_node_leaders
from loom.data.mixture import check_mixture_state, mixture_state, mixture_summary
from loom.data.streaming import StreamLoader, data_state, restore_data_state
from loom.errors import NonFiniteLossError, Preempted
from loom.hf.export import export
from loom.hf.modeling import model_args, plain_model, resolve_model
from loom.lora import converter as _lora  # noqa: F401  (registers the --lora-rank converter)
from loom.numerics import float8 as _float8  # noqa: F401  (registers the --float8 converter and hook)
from loom.observability.memory_snapshot import MemorySnapshots
from loom.observability.metrics import MAX_QUEUED, RunPlace, build_metrics, environment_facts
from loom.observability.profiling import maybe_profile
from loom.observability.progress import Progress
from loom.parallel.context import shard_batch
from loom.parallel.hf_load import build_hf_model, open_native_checkpoint
from loom.parallel.init import init_weights, load_weights
from loom.parallel.mesh import ParallelDims
from loom.parallel.parallelize import parallelize
from loom.parallel.pipeline import split_stages
from loom.runtime import flight
from loom.runtime.distributed import RankInfo, backend_for, init_distributed, teardown
from loom.runtime.host_hygiene import ScheduledGC
from loom.runtime.host_memory import retain_freed_memory
from loom.runtime.rundir import RunFolder
from loom.runtime.watchdog import StepWatchdog, collective_timeout_s, heartbeat_store
from loom.trainer.evaluate import build_evaluator
from loom.trainer.executor import build_executor
from loom.trainer.extensions import (
    StepContext,
    active_step_hooks,
    added_parameter_std,
    after_optimizer_step,
    convert_model,
)
from loom.trainer.optim import build_lr_scheduler, build_optimizer, clip_grad_norm
from loom.trainer.step import Batch, StepResult, ahead_on_device, parts_module

logger = logging.getLogger("loom")


def host_group(world_size: int) -> dist.ProcessGroup | None:
    """A group for host values (the stop request): the default one on gloo, else a gloo
    group beside the accelerator's, whose collectives would wait on the device queue;
    None for one process, which needs none."""
    if world_size == 1:
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


def agree_on_outdir(outdir: str | None) -> Path:
    """The given folder, or a timestamped one chosen by rank 0 and shared with every rank."""
    if outdir is None:
        chosen = [f"outputs/{datetime.now():%Y-%m-%d-%H%M%S}"]
        dist.broadcast_object_list(chosen, src=0)
        outdir = chosen[0]
    return Path(outdir)


class Trainer:
    """Holds the built components; `fit()` runs the loop."""

    def __init__(self, flags: JobConfig, info: RankInfo, dims: ParallelDims,
                 device: torch.device):
        """`flags`: the validated command line; everything below uses its resolved form."""
        self.info, self.dims, self.device = info, dims, device
        self.started = time.perf_counter()  # summary.json's setup_s counts from here
        dims.build_mesh(device.type)
        outdir = agree_on_outdir(flags.output.outdir)
        self.run_folder = RunFolder(outdir, info.rank, resume=flags.checkpoint.resume is not None,
                                    overwrite=flags.output.overwrite,
                                    adopt=flags.output.adopt_outdir)
        if self.run_folder.note:
            logger.info(self.run_folder.note)
        start = resolve(flags, info, dims, device, outdir)
        self.cfg = cfg = start.cfg
        self.seed, self.precision, resume = cfg.train.seed, start.precision, start.resume
        self.loader = build_dataloader(
            start.dataset, batch_size=cfg.train.batch_size, dp_rank=dims.dp_rank,
            dp_size=dims.dp_size, seed=self.seed, num_workers=cfg.data.num_workers)
        self.accum = cfg.train.grad_accum_steps
        self.steps_per_epoch = self.optimizer_steps_per_epoch()
        self.model_parts = self.build_model_parts()
        self.model = parts_module(self.model_parts)  # every parameter this rank holds
        self.executor = build_executor(self.model_parts, cfg, dims, device,
                                       end_of_text(start.dataset))
        self.evaluator = build_evaluator(start.val_datasets, cfg, dims, self.executor, device)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.optim, self.total_steps())
        self.checkpointer = Checkpointer(outdir, cfg.checkpoint.checkpoint_interval,
                                         cfg.checkpoint.keep_checkpoints,
                                         cfg.checkpoint.async_checkpoint, info.rank,
                                         resume.run_id if resume else new_run_id())
        self.loop = self.maybe_resume(resume)
        self.metrics = build_metrics(cfg, RunPlace(info.rank, dims, device, outdir, self.started),
                                     self.model, self.optimizer, plain_model)
        self.metrics.write_config(self.effective_config())
        self.token_group = dims.get_mesh("loss").get_group()
        self.hook_metrics: dict[str, float] = {}  # the last update's, kept over skipped steps
        self.skipped_in_a_row = 0
        self.stop_signal = 0  # the signal that asked this job to stop, agreed by all ranks
        # The fused AdamW skips a non-finite step on the device (its found_inf input), so
        # the step need not read whether to update; step hooks (MoE's expert-bias update)
        # run only after an update the host knows was applied.
        self.masked_update = bool(self.optimizer.defaults.get("fused")) \
            and not active_step_hooks(cfg)
        self.unread: list[tuple[int, torch.Tensor]] = []
        """Masked steps whose (applied, loss, gradient norm) the host has not read yet."""
        self.host_group = host_group(info.world_size)
        self.snapshots = MemorySnapshots(device, outdir, info.rank,
                                         cfg.output.memory_snapshot)

    def optimizer_steps_per_epoch(self) -> int:
        """Each optimizer step takes `accum` loader batches; a ragged remainder is dropped."""
        steps = len(self.loader) // self.accum
        if steps == 0:
            raise ConfigError(
                f"zero full optimizer steps per epoch: {len(self.loader)} batches per rank "
                f"cannot fill --grad-accum-steps {self.accum}; lower --grad-accum-steps or "
                "--batch-size, or add data")
        return steps

    @property
    def global_batch(self) -> int:
        return self.dims.global_batch_size(self.cfg.train.batch_size) * self.accum

    def maybe_resume(self, resume: ResumePoint | None) -> LoopState:
        """Load a checkpoint into model, optimizer and scheduler; the data position is kept
        in global samples, so it is exact whenever the global batch is unchanged."""
        if resume is None:
            return LoopState()
        path, saved = resume.path, resume.saved
        Checkpointer.load(path, self.model, self.optimizer, self.info.rank, saved)
        self.scheduler.load_state_dict(saved["scheduler"])
        if self.cfg.optim.lr != saved["settings"]["lr"]:
            rescale_lr(self.optimizer, self.scheduler, saved["settings"]["lr"], self.cfg.optim.lr)
        loop = LoopState(step=saved["step"], tokens_seen=saved["tokens_seen"],
                         samples_seen=saved["samples_seen"])
        restore_data_state(self.loader, saved)
        check_mixture_state(self.loader.dataset, saved, loop.samples_seen)
        if loop.samples_seen % self.global_batch:
            logger.warning("resuming with global batch %d, which does not divide the %d "
                           "samples consumed: continuing from the last whole step",
                           self.global_batch, loop.samples_seen)
        logger.info("resumed from %s at step %d", path, loop.step)
        explicit = self.cfg.checkpoint.resume not in ("auto", "latest")
        if explicit and self.info.rank == 0:
            aside = set_aside_later(self.checkpointer.root.parent, path, loop.step)
            if aside is not None:
                logger.info("--resume %s: the later checkpoints of the branch it leaves "
                            "were moved to %s (--resume auto continues this one)", path.name,
                            aside)
        return loop

    def build_model_parts(self) -> list[nn.Module]:
        """This rank's model parts: the whole model, or its pipeline stages, each built on
        the meta device, parallelized, then filled: by the name-seeded init, or from a
        Hugging Face checkpoint a native family imports (each tensor read by the first rank
        of its mesh and scattered). transformers' module has its own loader."""
        cfg = self.cfg
        if cfg.model.runs_transformers:
            return self.log_size([build_hf_model(cfg, self.dims, self.device,
                                                 backend_for(self.device))])
        with torch.device("meta"):
            whole = plain_model(cfg)
            parts = split_stages(whole, cfg.parallel, self.dims)
        if cfg.model.from_hub_format:
            read = open_native_checkpoint(cfg, whole).read
            fill = partial(load_weights, device=self.device, read=read, seed=self.seed,
                           added=added_parameter_std(cfg))
        else:
            fill = partial(init_weights, seed=self.seed, device=self.device,
                           added=added_parameter_std(cfg))
        for part in parts:
            convert_model(part, cfg)  # float8, QAT...: before tensor parallel sees the modules
            parallelize(part, self.dims, cfg.parallel,
                        loss_parallel=cfg.loss.loss_impl == "loss-parallel",
                        backend=backend_for(self.device))
            fill(part)
        return self.log_size(parts)

    def log_size(self, parts: list[nn.Module]) -> list[nn.Module]:
        n_params = sum(p.numel() for part in parts for p in part.parameters())
        logger.info("model: %s, %.2fM parameters in this rank's part(s)",
                    self.cfg.model.model or "custom", n_params / 1e6)
        return parts

    def effective_config(self) -> dict[str, Any]:
        return {**self.cfg.to_dict(), "world_size": self.info.world_size,
                "mesh": self.dims.degrees, "device": str(self.device),
                "global_batch_size": self.global_batch, "precision": vars(self.precision),
                **self.executor.layout(),
                "environment": {**environment_facts(), "restarts": self.info.restarts}}

    def train_step(self, micro_batches: list[Batch]) -> StepResult:
        """Forward and backward (the executor), clip, step. Nothing here reads the device
        under the masked update: whether the step was finite is read with the metrics, at
        the logging step (`settle`). Otherwise one host read decides the update."""
        micro_batches = [shard_batch(b, self.dims) for b in micro_batches]  # cp rank's part
        done = self.executor.forward_backward(micro_batches, self.metrics.forward_done)
        grad_norm = clip_grad_norm(self.executor.parameters(), self.cfg.optim.max_grad_norm,
                                   across=self.executor.norm_group)
        step_loss = self.step_loss(done.loss_sum, done.valid)
        finite = torch.isfinite(step_loss) & torch.isfinite(grad_norm.float())
        self.agree_on_stop()
        step = self.loop.step + 1
        if self.masked_update:
            applied = finite.float()
            self.optimizer.found_inf = 1.0 - applied  # read by the fused kernel: 1 skips
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
            self.unread.append((step, torch.stack([applied, step_loss.float(),
                                                   grad_norm.float()])))
        else:
            ok = bool(finite)  # the host read the masked update avoids
            if self.update_is_finite(step, ok, *((0.0, 0.0) if ok else (
                    float(step_loss), float(grad_norm)))):
                self.optimizer.step()
                self.hook_metrics = after_optimizer_step(
                    StepContext(self.model, self.token_group, self.cfg))
            applied = torch.tensor(float(ok), device=self.device)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(step_loss, grad_norm, done.valid, self.hook_metrics, applied)

    def step_loss(self, loss_sum: torch.Tensor, total_valid: torch.Tensor) -> torch.Tensor:
        """The step's loss: the owned loss shares summed over every rank (so the step's loss
        sum once), over its valid tokens; stays on the device."""
        total = loss_sum.float().reshape(1)
        dist.all_reduce(total)
        return total[0] / total_valid

    def agree_on_stop(self) -> None:
        """Whether any rank got SIGTERM or SIGINT (SIGTERM winning), agreed by every rank
        each step over a host group: the stop request never waits on the device."""
        if self.host_group is None:
            self.metrics.synced()
            return  # one process: its own request is the agreed one
        flags = torch.tensor([float(self.stop_signal == s)
                              for s in (signal.SIGTERM, signal.SIGINT)])
        dist.all_reduce(flags, group=self.host_group)
        self.metrics.synced()  # every rank leaves the host all-reduce together: stragglers' origin
        term, interrupt = flags.tolist()  # a host tensor: no device read
        self.stop_signal = signal.SIGTERM if term else signal.SIGINT if interrupt else 0

    def settle(self) -> None:
        """Read the unread steps' finite flags in one host read and apply the non-finite
        rules to each in order, as if each had been read at its own step: the update was
        already skipped on the device; a run that must stop stops here, after writing the
        metrics rows of the steps before the first that stops it."""
        if not self.unread:
            return
        steps = [step for step, _ in self.unread]
        values = torch.stack([v for _, v in self.unread]).tolist()
        self.unread = []
        for step, (applied, loss, grad_norm) in zip(steps, values, strict=True):
            try:
                self.update_is_finite(step, applied > 0.5, loss, grad_norm)
            except NonFiniteLossError:
                self.metrics.flush(before=step)
                raise

    def update_is_finite(self, step: int, finite: bool, loss: float, grad_norm: float) -> bool:
        if finite:
            self.skipped_in_a_row = 0
            return True
        t = self.cfg.train
        self.skipped_in_a_row += 1
        if not t.skip_nonfinite:
            raise NonFiniteLossError(
                f"non-finite loss or gradient at step {step} (loss {loss}, gradient "
                f"norm {grad_norm}); lower --lr, raise --warmup-steps, try --fp32, or "
                "pass --skip-nonfinite to skip such steps")
        if self.skipped_in_a_row >= t.max_skipped_steps:
            raise NonFiniteLossError(
                f"{self.skipped_in_a_row} steps in a row (up to step {step}) had a non-finite "
                "loss or gradient (--max-skipped-steps); lower --lr, raise --warmup-steps or "
                "try --fp32")
        logger.warning("step %d: non-finite loss or gradient, update skipped", step)
        return False

    def total_steps(self) -> int:
        total = self.steps_per_epoch * self.cfg.train.epochs
        return total if self.cfg.train.max_steps is None else min(total, self.cfg.train.max_steps)

    def batches(self) -> Iterator[tuple[int, int, list[Batch]]]:
        """(epoch, step in epoch, micro-batches) from the data position on, epoch by epoch.
        Step k of an epoch holds global samples k*G ... k*G+G-1 of the epoch's order."""
        first_epoch, first_step = divmod(self.loop.samples_seen // self.global_batch,
                                         self.steps_per_epoch)
        for epoch in range(first_epoch, self.cfg.train.epochs):
            skip = first_step if epoch == first_epoch else 0
            self.loader.sampler.set_epoch(epoch, start_step=skip * self.accum)
            micro = iter(self.loader)
            for bidx in range(skip, self.steps_per_epoch):
                yield epoch, bidx, [next(micro) for _ in range(self.accum)]

    def steps(self) -> Iterator[tuple[int, int, list[Batch]]]:
        """`batches()`, copied to an accelerator one step ahead (the copy of step k+1 is
        queued behind step k's work, so the step never waits for its data). Not for a
        stream, whose checkpointed position would then count the step drawn ahead."""
        if self.device.type == "cpu" or isinstance(self.loader, StreamLoader):
            return self.batches()
        return ahead_on_device(self.batches(), self.device)

    def fit(self) -> None:
        """The loop; a SIGTERM or SIGINT ends it after the current step, and the summary
        and plots are written for the steps done either way."""
        total, out = self.total_steps(), self.cfg.output
        micro_batch = self.dims.global_batch_size(self.cfg.train.batch_size)
        self.metrics.begin(total, start_step=self.loop.step, tokens_seen=self.loop.tokens_seen,
                           input_iter=self.loop.samples_seen // micro_batch)
        previous = {s: signal.signal(s, self.request_stop) for s in (signal.SIGTERM,
                                                                      signal.SIGINT,
                                                                      signal.SIGUSR1)}
        watchdog = StepWatchdog(self.cfg.train.comm_timeout_s, self.metrics.outdir,
                                self.info.rank, self.info.world_size,
                                heartbeat_store(self.cfg.train.comm_timeout_s),
                                flight.waiting_in)
        watchdog.start(self.loop.step)
        cadence = Progress(out.log_every, enabled=False)  # the metrics' logging steps
        cadence.begin(total, self.loop.step)
        collector = ScheduledGC(self.cfg.train.gc_every)
        collector.begin()
        try:
            with maybe_profile(out, self.metrics.outdir, self.info.rank, total) as profiler:
                for epoch, bidx, micro in itertools.islice(self.steps(),
                                                           max(0, total - self.loop.step)):
                    try:
                        result = self.train_step(micro)
                    except torch.OutOfMemoryError as e:
                        raise self.snapshots.out_of_memory(e) from e
                    self.advance()
                    self.snapshots.after_step(self.loop.step)
                    collector.after_step(self.loop.step)
                    step = self.loop.step
                    if (cadence.due(step) or self.checkpointer.due(step) or step == total
                            or self.stop_signal or len(self.unread) >= MAX_QUEUED):
                        self.settle()
                    val = self.maybe_evaluate(final=step == total)
                    self.metrics.log_step(step, epoch, bidx, result.loss,
                                          result.grad_norm, {**result.moe, **val},
                                          valid_tokens=result.valid_tokens, batches=micro,
                                          applied=result.applied)
                    profiler.step()
                    self.maybe_checkpoint(final=self.loop.step == total)
                    watchdog.beat(self.loop.step)
        except Preempted:
            self.metrics.finish(self.data_summary())
            raise
        else:
            self.metrics.finish(self.data_summary())
        finally:
            collector.finish()
            self.snapshots.finish()
            watchdog.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.checkpointer.finish()

    def data_summary(self) -> dict[str, Any]:
        """What summary.json adds about the data: tokens seen per mixture source."""
        return mixture_summary(self.loader.dataset, self.loop.samples_seen,
                               self.cfg.data.seq_len)

    def maybe_evaluate(self, final: bool) -> dict[str, float]:
        if self.evaluator is None:
            return {}
        return self.evaluator.maybe_evaluate(self.loop.step, final)

    def advance(self) -> None:
        tokens = self.global_batch * self.cfg.data.seq_len
        self.loop = LoopState(step=self.loop.step + 1,
                              tokens_seen=self.loop.tokens_seen + tokens,
                              samples_seen=self.loop.samples_seen + self.global_batch)

    def request_stop(self, signum: int, _frame: object) -> None:
        """Schedulers send SIGTERM before the kill (or SIGUSR1 as Slurm's `--signal=USR1@S`
        warning, taken as SIGTERM: save and exit 143, which a requeue script looks for),
        users press Ctrl-C: finish the step, then stop. A second Ctrl-C interrupts at once."""
        self.stop_signal = signal.SIGTERM if signum == signal.SIGUSR1 else signum
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            logger.warning("Ctrl-C: stopping after this step (press again to abort)")

    def maybe_checkpoint(self, final: bool) -> None:
        ckpt, step = self.checkpointer, self.loop.step
        if self.stop_signal:
            name, grace = signal.Signals(self.stop_signal).name, self.cfg.checkpoint.sigterm_grace_s
            if ckpt.enabled and ckpt.last_save_seconds <= grace:
                self.save_checkpoint()
            elif ckpt.enabled:
                logger.warning("%s: last save took %.1f s > %.1f s grace; not saving",
                               name, ckpt.last_save_seconds, grace)
            raise Preempted(f"stopped by {name} after step {step}; summary and plots in "
                            f"{self.metrics.outdir}", self.stop_signal)
        if ckpt.due(step) or (final and ckpt.enabled):
            self.save_checkpoint()

    def save_hf(self) -> None:
        """Global rank 0 exports the final checkpoint to <outdir>/hf as `loom export` does;
        the other ranks wait, and a failure ends every rank with rank 0's line."""
        checkpoint = self.checkpointer.root / f"step-{self.loop.step}"
        target = self.checkpointer.root.parent / "hf"

        def write() -> None:
            done = export(checkpoint, target, trust_remote_code=self.cfg.model.trust_remote_code)
            logger.info("--save-hf: %s -> %s (%s)", checkpoint, target, done)

        on_node_leaders(write, leader=self.info.rank == 0)

    def save_checkpoint(self) -> None:
        start = time.perf_counter()
        self.checkpointer.save(self.loop.step, self.model, self.optimizer, {
            **vars(self.loop), "scheduler": self.scheduler.state_dict(),
            "global_batch": self.global_batch, "mesh": self.dims.degrees,
            "model_args": vars(model_args(self.cfg)), "settings": run_settings(self.cfg),
            "architecture": architecture(self.cfg, model_args(self.cfg)),
            **data_state(self.loader), **mixture_state(self.loader.dataset,
                                                       self.loop.samples_seen)})
        self.checkpointer.last_save_seconds = time.perf_counter() - start

    def close(self) -> None:
        self.metrics.close()
        self.run_folder.close()


def run(cfg: JobConfig, info: RankInfo, device: torch.device) -> Trainer:
    """Train one job in an initialised process group; returns the trainer for inspection."""
    trainer = Trainer(cfg, info, ParallelDims.from_config(cfg.parallel, info.world_size), device)
    try:
        trainer.fit()
        if trainer.cfg.checkpoint.save_hf:
            trainer.save_hf()
    finally:
        trainer.close()
    return trainer


def main(cfg: JobConfig, info: RankInfo) -> None:
    """Train a validated config (see `loom.cli.run_train`, which checks the flags and the
    mesh before any heavy import or collective)."""
    cfg = resolve_model(resume_on_restart(cfg, info.restarts))
    for warning in cfg.warnings:
        logger.warning(warning)
    device = init_distributed(info, collective_timeout_s(cfg.train.comm_timeout_s))
    if device.type == "cpu" and cfg.train.host_memory == "retain" and retain_freed_memory():
        logger.info("host memory: freed blocks kept for reuse (--host-memory release: glibc's "
                    "default)")
    run(cfg, info, device)
    teardown()  # only after success: a failed rank must exit at once, not wait in a barrier
