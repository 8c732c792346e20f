"""`loom train`: config -> runtime -> mesh -> data -> model -> parallelize -> optimizer -> loop.
The Trainer holds the built components and runs the loop; what start-up builds once lives in
`setup` and `model_parts`, the entry points (`main`, `run`) in `entry`."""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

from loom.checkpoint.checkpointer import Checkpointer, LoopState
from loom.checkpoint.resume import architecture, new_run_id, run_settings
from loom.config import JobConfig
from loom.data.loaders import build_dataloader, end_of_text
from loom.data.mixture import mixture_state, mixture_summary
from loom.data.streaming import data_state
from loom.errors import NonFiniteLossError, Preempted
from loom.lmeval import build_task_evaluation
from loom.lora import converter as _lora  # noqa: F401  (registers the --lora-rank converter)
from loom.models.resolve import model_args, plain_model
from loom.numerics import float8 as _float8  # noqa: F401  (registers the --float8 converter and hook)
from loom.observability.memory_snapshot import MemorySnapshots
from loom.observability.metrics import MAX_QUEUED, RunPlace, build_metrics
from loom.observability.profiling import maybe_profile
from loom.observability.progress import Progress
from loom.parallel.context import shard_batch
from loom.parallel.mesh import ParallelDims
from loom.parallel.single import step_autocast
from loom.protocols.extensions import StepContext, after_optimizer_step
from loom.runtime import flight
from loom.runtime.distributed import RankInfo, summed
from loom.runtime.host_hygiene import ScheduledGC
from loom.runtime.rundir import RunFolder
from loom.runtime.watchdog import StepWatchdog, heartbeat_store
from loom.trainer.evaluate import build_evaluator
from loom.trainer.executor import build_executor
from loom.trainer.model_parts import build_model_parts
from loom.trainer.optim import build_lr_scheduler, build_optimizer, clip_grad_norm
from loom.trainer.reading import steps_until
from loom.trainer.resolve import resolve
from loom.trainer.setup import (
    agree_on_outdir,
    effective_config,
    host_group,
    maybe_resume,
    optimizer_steps_per_epoch,
)
from loom.trainer.step import Accumulated, Batch, StepResult, parts_module

logger = logging.getLogger("loom")


class Trainer:
    """Holds the built components; `fit()` runs the loop."""

    def __init__(self, flags: JobConfig, info: RankInfo, dims: ParallelDims,
                 device: torch.device):
        """`flags`: the validated command line; everything below uses its resolved form.
        A start-up that fails releases the run folder it claimed: the caller (`loom.fit`
        in a notebook) may fix the input and try again in the same process."""
        try:
            self.start(flags, info, dims, device)
        except BaseException:
            if hasattr(self, "run_folder"):
                self.run_folder.close()
            raise

    def start(self, flags: JobConfig, info: RankInfo, dims: ParallelDims,
              device: torch.device) -> None:
        self.info, self.dims, self.device = info, dims, device
        self.started = time.perf_counter()  # summary.json's setup_s counts from here
        dims.build_mesh(device.type)
        outdir = agree_on_outdir(flags.output.outdir, dims)
        self.run_folder = RunFolder(outdir, info.rank, resume=flags.checkpoint.resume is not None,
                                    overwrite=flags.output.overwrite,
                                    adopt=flags.output.adopt_outdir)
        if self.run_folder.note:
            logger.info(self.run_folder.note)
        start = resolve(flags, info, dims, device, outdir)
        self.cfg = cfg = start.cfg
        self.seed, self.precision, resume = cfg.train.seed, start.precision, start.resume
        self.loader = build_dataloader(
            start.dataset, batch_size=cfg.train.batch_size, dp_rank=dims.data_rank,
            dp_size=dims.data_size, seed=self.seed, num_workers=cfg.data.num_workers)
        self.accum = cfg.train.grad_accum_steps
        self.steps_per_epoch = optimizer_steps_per_epoch(self.loader, self.accum)
        self.model_parts = build_model_parts(cfg, dims, device, self.seed)
        self.model = parts_module(self.model_parts)  # every parameter this rank holds
        self.executor = build_executor(self.model_parts, cfg, dims, device,
                                       end_of_text(start.dataset))
        tasks = build_task_evaluation(cfg, self.model, device, outdir, info.is_main,
                                      step_autocast(dims, cfg.parallel, device.type))
        self.evaluator = build_evaluator(start.val_datasets, cfg, dims, self.executor, device,
                                         [tasks])
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.optim, self.total_steps())
        self.checkpointer = Checkpointer(outdir, cfg.checkpoint.checkpoint_interval,
                                         cfg.checkpoint.keep_checkpoints,
                                         cfg.checkpoint.async_checkpoint, info.rank,
                                         resume.run_id if resume else new_run_id())
        self.loop = maybe_resume(resume, cfg, self.model, self.optimizer, self.scheduler,
                                 self.loader, self.checkpointer, info.rank, self.global_batch,
                                 self.executor)
        self.metrics = build_metrics(cfg, RunPlace(info.rank, dims, device, outdir, self.started),
                                     self.model, self.optimizer, plain_model)
        self.metrics.write_config(effective_config(cfg, info, dims, device, self.global_batch,
                                                   self.precision, self.executor))
        self.token_group = dims.get_mesh("loss").get_group()
        self.hook_metrics: dict[str, torch.Tensor | float] = {}  # the last run's
        self.skipped_in_a_row = 0
        self.stop_signal = 0  # the signal that asked this job to stop, agreed by all ranks
        # The fused AdamW skips a non-finite step on the device (its found_inf input), so
        # the step need not read whether to update; step hooks mask their own work with
        # the same device flag (`StepContext.applied`).
        self.masked_update = bool(self.optimizer.defaults.get("fused")) and not self.executor.votes
        self.unread: list[tuple[int, torch.Tensor]] = []
        """Masked steps whose (applied, loss, gradient norm) the host has not read yet."""
        self.host_group = host_group(info.world_size)
        self.snapshots = MemorySnapshots(device, outdir, info.rank,
                                         cfg.output.memory_snapshot)
        # last: a restarted replica group's live recovery takes a step (`update`)
        self.loop = self.executor.share_state(self)

    @property
    def global_batch(self) -> int:
        return self.dims.global_batch_size(self.cfg.train.batch_size) * self.accum

    def train_step(self, micro_batches: list[Batch]) -> StepResult:
        """Forward and backward (the executor), clip, step. Nothing here reads the device
        under the masked update: whether the step was finite is read with the metrics, at
        the logging step (`settle`). Otherwise one host read decides the update."""
        micro_batches = [shard_batch(b, self.dims) for b in micro_batches]  # cp rank's part
        return self.update(self.executor.forward_backward(micro_batches,
                                                          self.metrics.forward_done))

    def update(self, done: Accumulated) -> StepResult:
        """The step after the backward: clip, the optimizer, the step hooks, the schedule
        (also a replica group's join step, whose gradients are the other groups')."""
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
            if done.trained and self.update_is_finite(step, ok, *((0.0, 0.0) if ok else (
                    float(step_loss), float(grad_norm)))):
                self.optimizer.step()
            applied = torch.tensor(float(ok and done.trained > 0), device=self.device)
        # every hook masks its own work with `applied`: a skipped step leaves it inert
        self.hook_metrics = {**done.metrics, **self.executor.after_update(),
                             **after_optimizer_step(  # with MTP's loss
            StepContext(self.model, self.token_group, self.cfg, applied, self.dims.stage_group))}
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(step_loss, grad_norm, done.valid, self.hook_metrics, applied,
                          done.trained)

    def step_loss(self, loss_sum: torch.Tensor, total_valid: torch.Tensor) -> torch.Tensor:
        """The step's loss: the owned loss shares summed over every rank (so the step's loss
        sum once), over its valid tokens; stays on the device."""
        return summed(loss_sum.float()) / total_valid

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
                for epoch, bidx, micro in steps_until(self, total):
                    try:
                        result = self.train_step(micro)
                    except torch.OutOfMemoryError as e:
                        raise self.snapshots.out_of_memory(e) from e
                    self.advance(result.trained)
                    self.snapshots.after_step(self.loop.step)
                    collector.after_step(self.loop.step)
                    step = self.loop.step
                    if (cadence.due(step) or self.checkpointer.due(step) or step == total
                            or self.stop_signal or len(self.unread) >= MAX_QUEUED):
                        self.settle()
                    val = self.maybe_evaluate(final=step == total)
                    self.metrics.log_step(step, epoch, bidx, result.loss,
                                          result.grad_norm, {**result.hook_metrics, **val},
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
        return {**mixture_summary(self.loader.dataset, self.loop.samples_seen,
                                  self.cfg.data.seq_len), **self.executor.summary()}

    def maybe_evaluate(self, final: bool) -> dict[str, float]:
        return {} if self.evaluator is None else self.evaluator.maybe_evaluate(self.loop.step,
                                                                                final)

    def advance(self, trained: float = 1.0) -> None:
        tokens = round(self.global_batch * trained) * self.cfg.data.seq_len
        self.loop = LoopState(self.loop.step + 1, self.loop.tokens_seen + tokens,
                              self.loop.samples_seen + self.global_batch)  # data: every batch

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

    def save_checkpoint(self) -> None:
        start = time.perf_counter()
        self.checkpointer.save(self.loop.step, self.model, self.optimizer, {
            **vars(self.loop), "scheduler": self.scheduler.state_dict(),
            "global_batch": self.global_batch, "mesh": self.dims.degrees,
            "model_args": vars(model_args(self.cfg)), "settings": run_settings(self.cfg),
            "architecture": architecture(self.cfg, model_args(self.cfg)),
            **data_state(self.loader), **mixture_state(self.loader.dataset,
                                                       self.loop.samples_seen)},
            own=self.executor.own_state())
        self.checkpointer.last_save_seconds = time.perf_counter() - start

    def close(self) -> None:
        self.metrics.close()
        self.run_folder.close()

