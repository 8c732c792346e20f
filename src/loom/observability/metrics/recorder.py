"""The loop's metrics object: `Metrics` writes a row per step (rank 0 adds progress, the
trackers (W&B, TensorBoard), the summary and plots). The no-op (`NullMetrics`, --no-metrics),
the `RunMetrics` protocol both answer to, config.json and `RunPlace` are in `sink`;
building either from the config is `build.build_metrics`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from loom.observability import flops
from loom.observability.metrics.facts import RunFacts
from loom.observability.metrics.health import (
    HEALTH_KEYS,
    INPUT_KEYS,
    LOGITS_KEYS,
    LogitsTracker,
    exact_float_parts,
    input_range,
    memory_stats,
    tensor_stats,
)
from loom.observability.metrics.rows import RowWriter, StepClock, gather_floats, timing_spread
from loom.observability.metrics.sink import MAX_QUEUED, RunPlace, write_config
from loom.observability.metrics.summary import write_summary
from loom.observability.progress import Progress
from loom.observability.tracking import Histograms, Tracker, WandbRun
from loom.runtime import flight
from loom.runtime.straggler import StragglerWatch, arrivals, own_step_times, spread

logger = logging.getLogger("loom")


@dataclass
class PendingRow:
    """A step logged but not yet read: its device columns wait for the logging step."""

    step: int
    epoch: int
    bidx: int
    names: tuple[str, ...]
    values: torch.Tensor
    """The step's device columns, flat, in `names` order; read with every pending row's."""
    times: Callable[[], tuple[float, float, float]]
    lr: float
    host: dict[str, Any]
    """Columns already on the host: memory, the micro-batch count, the MoE and eval ones."""



class Metrics:
    """One rank's per-step rows; rank 0 adds progress, trackers, summary and plots.
    `trackers` receive every row as it is written; `wandb` (one of them, when on) also
    receives the histograms."""

    def __init__(self, place: RunPlace, facts: RunFacts, *, health_every: int,
                 progress: Progress, wandb: WandbRun | None, histograms: Histograms,
                 remeasure: Callable[[], flops.Peak], logits: LogitsTracker | None = None,
                 trackers: tuple[Tracker, ...] = ()):
        self.outdir, self.rank, self.device = place.outdir, place.rank, place.device
        self.outdir.mkdir(parents=True, exist_ok=True)
        self.facts, self.health_every, self.started = facts, health_every, place.started
        self.progress, self.wandb, self.histograms = progress, wandb, histograms
        self.trackers = [*((wandb,) if wandb is not None else ()), *trackers]
        self.clock = StepClock(self.device)
        self.mfu = flops.MfuMeter(facts.flops_per_rank, flops.Peak(facts.peak_flops,
                                  facts.peak_source), remeasure)
        self.rows_path = self.outdir / f"metrics-{self.rank}.jsonl"
        self.rows: RowWriter | None = None
        self.step, self.lr, self.tokens_seen = 0, 0.0, 0
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.grad_stats: torch.Tensor | None = None
        self.logits = logits
        self.input_iter = self.opt_iter = 0
        self.pending: list[PendingRow] = []
        self.last_lr = 0.0  # what a row shows until the optimizer applies an update
        self.stragglers = StragglerWatch([], log=self.rank == 0)
        self.sync_ns: tuple[int | None, int | None] = (None, None)
        """(previous, latest) moment the ranks left a step's sync together (`synced`)."""
        self.first_sync_ns: int | None = None
        """The run's first such moment: the window it begins is not judged
        (`loom.runtime.straggler`)."""
        self.sync_blocked = (0.0, 0.0)
        """`flight.blocked_s()` at those two moments."""
        self.t_begin = time.perf_counter()

    def write_config(self, config: dict[str, Any]) -> None:
        self.stragglers.hosts = write_config(self.outdir, self.rank,
                                             {**config, "derived": asdict(self.facts)})

    def watch(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Gradients are read in an optimizer step pre-hook: after clipping, before the
        update and zero_grad, without touching train_step."""
        self.model, self.optimizer = model, optimizer
        self.hook = optimizer.register_step_pre_hook(self._before_update)
        self.histograms.attach(model)
        if self.logits is not None:
            self.logits.attach(model)

    def health_due(self, step: int) -> bool:
        """Health statistics at this step: every K steps, or (-1) at the logging steps."""
        if self.health_every < 0:
            return self.progress.due(step)
        return self.health_every > 0 and step % self.health_every == 0

    def _before_update(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        step = self.step + 1
        self.lr = float(optimizer.param_groups[0]["lr"])  # a host float: no device read
        if self.health_due(step):
            grads = (p.grad for g in optimizer.param_groups for p in g["params"])
            self.grad_stats = tensor_stats((g for g in grads if g is not None), self.device)
        self.histograms.gradients(step)

    def begin(self, total_steps: int, start_step: int = 0, tokens_seen: int = 0,
              input_iter: int = 0) -> None:
        """`tokens_seen`, `input_iter` (global micro-batches drawn): the resumed run's counts,
        which later rows continue; the optimizer's own count is read from its state."""
        self.rows, self.step = RowWriter(self.rows_path), start_step
        self.tokens_seen, self.input_iter = tokens_seen, input_iter
        self.opt_iter = optimizer_updates(self.optimizer) if self.optimizer is not None else 0
        f = self.facts
        logger.info("%d steps of %s tokens (global batch %d = %d per dp rank x dp %d), "
                    "%.4g GFLOP/step", total_steps, f"{f.tokens_per_step:,}",
                    f.global_batch_size, f.global_batch_size // f.dp_size, f.dp_size,
                    f.flops_per_step / 1e9)
        logger.info("MFU = %.4g GFLOP per rank / step time / %.4g TFLOP/s (%s peak); "
                    "model FLOPs, recompute not counted%s", f.flops_per_rank / 1e9,
                    f.peak_flops / 1e12, f.peak_source, "" if f.flops_exact else "; a lower bound")
        self.progress.begin(total_steps, start_step)
        self.t_begin = time.perf_counter()
        self.sync_ns, self.first_sync_ns = (None, None), None
        self.clock.start()

    def synced(self) -> None:
        """The trainer's mark right after the step's all-reduce was read: every rank leaves
        it at the same moment, the origin the next step's arrivals are measured from."""
        self.sync_ns = (self.sync_ns[1], time.time_ns())
        if self.first_sync_ns is None:
            self.first_sync_ns = self.sync_ns[1]
        self.sync_blocked = (self.sync_blocked[1], flight.blocked_s())

    def rank_times(self, step: int, times: tuple[float, float, float]) -> dict[str, float]:
        """At a logging step: the timing spread over ranks and, when this step was measured
        from a sync point, each rank's own step time (`loom.runtime.straggler`), fed to the watch
        unless the window began at the run's first sync point."""
        since, until = self.sync_ns
        from_since, to_until, count = (0.0, 0.0, 0) if since is None or until is None else \
            arrivals(flight.arrival_times(), since, until)
        blocked = self.sync_blocked[1] - self.sync_blocked[0]
        gathered = gather_floats([*times, from_since, to_until, float(count), blocked],
                                 self.device)
        columns = timing_spread(gathered)
        window_s = (until - since) / 1e9 if since is not None and until is not None else 0.0
        own = own_step_times(window_s, *([g[i] for g in gathered] for i in (3, 4)),
                             [int(g[5]) for g in gathered], [g[6] for g in gathered])
        if own is not None and len(own) > 1 and window_s > 0:
            columns.update(spread(own))
            if since != self.first_sync_ns:  # the first step's one-off work: not judged
                self.stragglers.observe(step, own)
        return columns

    def forward_done(self) -> None:
        self.clock.forward_done()

    def _health(self, step: int) -> list[torch.Tensor]:
        if not self.health_due(step) or self.model is None:
            return []
        grads = self.grad_stats if self.grad_stats is not None else torch.full(
            (3,), float("nan"), device=self.device)
        self.grad_stats = None
        return [grads, tensor_stats(self.model.parameters(), self.device)]

    def log_step(self, step: int, epoch: int, bidx: int, loss: torch.Tensor,
                 grad_norm: torch.Tensor, extra: dict[str, Any] | None = None, *,
                 valid_tokens: torch.Tensor | None = None,
                 batches: list[dict[str, torch.Tensor]] | None = None,
                 applied: torch.Tensor | None = None,
                 ) -> dict[str, Any] | None:
        """Queue the step's row; at a logging step (or one with histograms to write) read
        and write every queued row, returning the last. `extra`: more columns (the step
        hooks' metrics, as device scalars; evaluation's, host values); `valid_tokens`: the
        step's valid labels over the loss mesh (on the device); `batches`: this rank's
        micro-batches; `applied`: 1.0 where the optimizer applied the update, 0.0 where a
        non-finite step was skipped (on the device).

        Nothing here reads the device: the step's columns stay there until the logging
        step, so the host keeps launching work while the device runs."""
        self.step = step
        names, values = self.device_columns(step, loss, grad_norm, valid_tokens)
        # the allocator's statistics are host calls: at the logging steps only
        memory = memory_stats(self.device) if self.progress.due(step) else {}
        host: dict[str, Any] = {**memory, **{k: v for k, v in (extra or {}).items()
                                             if not isinstance(v, torch.Tensor)}}
        on_device = {k: v for k, v in (extra or {}).items() if isinstance(v, torch.Tensor)}
        if on_device:  # the step hooks' metrics: read with the row's other device columns
            names = (*names, *on_device)
            values = [*values, *(v.detach().float().reshape(1).to(self.device)
                                 for v in on_device.values())]
        if batches:
            names, values = (*names, *INPUT_KEYS), [*values, input_range(batches, self.device)]
            host["micro_batches"] = len(batches)
        if applied is not None:
            names, values = (*names, "opt/applied"), [*values, applied.detach().float().reshape(1)]
        self.pending.append(PendingRow(step, epoch, bidx, names, torch.cat(values),
                                       self.clock.stop(), self.lr, host))
        row = None
        if (self.progress.due(step) or self.histograms.recorded()
                or len(self.pending) >= MAX_QUEUED):
            row = self.flush(spread=self.progress.due(step))
        self.histograms.flush(step, self.wandb)
        self.clock.start()
        return row

    def flush(self, before: int | None = None, spread: bool = False) -> dict[str, Any] | None:
        """Read every queued row's device columns in one host read and write the rows
        (those of steps before `before` only, dropping the rest: a run that stops there);
        `spread`: add the ranks' timing spread to the last (a collective: logging steps)."""
        pending = [p for p in self.pending if before is None or p.step < before]
        self.pending = []
        if not pending:
            return None
        values = torch.cat([p.values for p in pending]).tolist()
        row: dict[str, Any] | None = None
        offset = 0
        for i, p in enumerate(pending):
            columns = dict(zip(p.names, values[offset:offset + len(p.names)], strict=True))
            offset += len(p.names)
            row = self.write_row(p, columns, spread=spread and i == len(pending) - 1)
        return row

    def write_row(self, p: PendingRow, columns: dict[str, float],
                  spread: bool = False) -> dict[str, Any]:
        """One step's row from its read columns; `opt/iter` and `opt/lr` count only the
        updates the optimizer applied (a skipped step keeps the last applied one's lr)."""
        applied = columns.pop("opt/applied", 1.0) > 0.5
        if applied:
            self.opt_iter += 1
            self.last_lr = p.lr
        elif any(k in columns for k in HEALTH_KEYS[:3]):
            columns.update({k: float("nan") for k in HEALTH_KEYS[:3]})  # no update read them
        lr = self.last_lr
        if "valid/high" in columns:
            high, low = columns.pop("valid/high"), columns.pop("valid/low")
            columns["labels/valid"] = int(high) * 2**24 + int(low)
        self.tokens_seen += p.host.get("train/tokens", self.facts.tokens_per_step)
        dt, dtf, dtb = p.times()
        row = self.row(p.step, p.epoch, p.bidx, columns.pop("train/loss"),
                       columns.pop("grad/norm_preclip"), (dt, dtf, dtb), lr)
        host = dict(p.host)
        n_batches = host.pop("micro_batches", 0)
        if "input/min/high" in columns:
            for key in ("input/min", "input/max"):
                columns[key] = int(columns.pop(f"{key}/high")) * 2**24 + int(
                    columns.pop(f"{key}/low"))
        row.update(columns)
        if n_batches:
            self.input_iter += n_batches
            row["input/iter"] = self.input_iter
        row["opt/iter"] = self.opt_iter
        if spread:
            row.update(self.rank_times(p.step, (dt, dtf, dtb)))
        row.update(host)
        self.rows.write(row)
        self.progress.update(row)
        for tracker in self.trackers:
            tracker.log(row, p.step)
        return row

    def device_columns(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor,
                       valid_tokens: torch.Tensor | None,
                       ) -> tuple[tuple[str, ...], list[torch.Tensor]]:
        """Every column the step left on the device, as float32 values read later in one
        host read: loss, gradient norm, valid labels (exact), the logits' and the health
        statistics."""
        named = [(("train/loss", "grad/norm_preclip"),
                  torch.cat([loss.detach().float().reshape(1),
                             grad_norm.detach().float().reshape(1)]))]
        if valid_tokens is not None:
            named.append((("valid/high", "valid/low"), exact_float_parts(valid_tokens.detach())))
        logits = self.logits.take() if self.logits is not None else None
        if logits is not None:
            named.append((LOGITS_KEYS, logits))
        health = self._health(step)
        if health:
            named.append((HEALTH_KEYS, torch.cat(health)))
        return (tuple(k for keys, _ in named for k in keys),
                [t.reshape(-1).float() for _, t in named])

    def row(self, step: int, epoch: int, bidx: int, loss: float, grad_norm: float,
            times: tuple[float, float, float], lr: float) -> dict[str, Any]:
        f, (dt, dtf, dtb) = self.facts, times
        return {"train/iter": step, "train/epoch": epoch, "train/bidx": bidx,
                "train/loss": loss, "train/dt": dt, "train/dtf": dtf, "train/dtb": dtb,
                "train/tokens": f.tokens_per_step, "train/tokens_seen": self.tokens_seen,
                "train/tps": f.tokens_per_step / dt,
                "train/tps_per_gpu": f.tokens_per_step / dt / f.world_size,
                "train/tflops": f.flops_per_rank / dt / 1e12,
                "train/mfu": self.mfu(dt),
                "grad/norm_preclip": grad_norm, "opt/lr": lr}

    def timings(self) -> dict[str, float]:
        end = time.perf_counter()
        return {"setup_s": self.t_begin - self.started, "train_s": end - self.t_begin,
                "total_s": end - self.started}

    def finish(self, extra: dict[str, Any] | None = None) -> None:
        """summary.json (with `extra`: the trainer's facts about the data), plots and the
        loss text plot (rank 0), then close the trackers."""
        if self.rows is not None:
            self.flush()
        timings = self.timings()
        if self.rows is not None:
            self.rows.close()
        summary = None
        if self.rank == 0:
            facts = {**asdict(self.facts), "peak_flops": self.mfu.peak.flops}
            summary = write_summary(self.outdir, {**facts, **(extra or {})}, timings,
                                    self.stragglers.summary())
        self.close_trackers(summary)

    def close_trackers(self, summary: dict[str, Any] | None) -> None:
        trackers, self.trackers, self.wandb = self.trackers, [], None
        for tracker in trackers:
            tracker.finish(summary)

    def close(self) -> None:
        if self.rows is not None:
            self.rows.close()
        self.histograms.close()
        if self.logits is not None:
            self.logits.close()
        if self.model is not None:
            self.hook.remove()
        self.close_trackers(None)


def optimizer_updates(optimizer: torch.optim.Optimizer) -> int:
    """Updates the optimizer has applied (AdamW's per-parameter `step`, which a skipped
    step does not advance), read once when the loop begins: after a resume, its count."""
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0
