"""Per-step metrics and the run folder (spec/metrics.md).

Every rank writes `metrics-<rank>.jsonl`; rank 0 also writes `config.json` and, at the end,
`summary.json`, `plots/` and a text plot of the loss. A step costs one host sync: loss,
pre-clip norm and any health statistics travel together in one `.tolist()`. Health
statistics run every `health_every` steps as a foreach norm and one aminmax per tensor,
never a sync per parameter. `--no-metrics` ($LOOM_METRICS=0) swaps in `NullMetrics`, the
overhead baseline.
"""

from __future__ import annotations

import json
import logging
import platform
import resource
import socket
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from loom import flops
from loom.config import JobConfig
from loom.data.cache import default_cache_dir
from loom.mesh import ParallelDims
from loom.plots import write_plots
from loom.precision import resolve_precision, torch_dtype
from loom.progress import Progress, text_plot
from loom.runtime import RankInfo
from loom.tracking import Histograms, WandbRun

logger = logging.getLogger("loom")

_clock_origin = [time.perf_counter()]
"""Start of the current run's setup: loom's import, then the end of the previous run."""

GIB = 2**30
MFU_KIND = "model FLOPs: forward + backward once, activation recompute not counted"
HEALTH_KEYS = ("grad/norm", "grad/max_abs", "grad/nonfinite",
               "param/norm", "param/max_abs", "param/nonfinite")


def environment_facts() -> dict[str, Any]:
    return {"torch": torch.__version__, "python": platform.python_version(),
            "hostname": socket.gethostname()}


@dataclass(frozen=True)
class RunFacts:
    """Derived once per run; recorded in config.json and summary.json."""

    global_batch_size: int
    tokens_per_step: int
    parameters: int
    flops_per_step: float
    """Forward + backward FLOPs of the whole model over one global step."""
    flops_per_rank: float
    """This rank's share: its dp slice of the batch, split tp ways."""
    flops_exact: bool
    peak_flops: float
    peak_source: str
    world_size: int
    dp_size: int
    tp: int
    mfu_kind: str = MFU_KIND


class StepClock:
    """Device-synchronised time of a step, split into data+forward+loss (`dtf`) and
    backward+optimizer (`dtb`); the marks may repeat per micro-batch and accumulate."""

    def __init__(self, device: torch.device):
        self.sync = flops.synchronizer(device)
        self.start()

    def start(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.dtf = self.dtb = 0.0

    def _lap(self) -> float:
        self.sync()
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        return elapsed

    def forward_done(self) -> None:
        self.dtf += self._lap()

    def backward_done(self) -> None:
        self.dtb += self._lap()

    def stop(self) -> tuple[float, float, float]:
        """(dt, dtf, dtb); what follows the last forward mark counts as backward."""
        self.backward_done()
        return self.last - self.t0, self.dtf, self.dtb


def local_shards(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)
    return [t.detach() for t in local if t.numel()]


def tensor_stats(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """(L2 norm, max |x|, count of tensors holding a NaN/Inf) over this rank's local shards,
    left on the device, no host sync. aminmax, not the inf-norm: 20x faster on CPU."""
    local = local_shards(tensors)
    if not local:
        return torch.zeros(3, device=device)
    norms = torch.stack(torch._foreach_norm(local, 2, dtype=torch.float32))
    extremes = torch.stack([torch.stack(torch.aminmax(t)).float() for t in local])  # (n, 2)
    maxes = extremes.abs().amax(dim=1)  # NaN propagates, so a NaN tensor counts as nonfinite
    return torch.stack([norms.norm(), maxes.max(), (~maxes.isfinite()).sum().float()])


def peak_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def current_rss() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    except OSError:
        return peak_rss()


def memory_stats(device: torch.device) -> dict[str, float]:
    """Allocated / reserved device memory (current and peak, GiB); process RSS on the CPU."""
    if device.type in ("cuda", "xpu"):
        mod = getattr(torch, device.type)
        return {"train/mem_alloc": mod.memory_allocated(device) / GIB,
                "train/mem_alloc_peak": mod.max_memory_allocated(device) / GIB,
                "train/mem_reserved": mod.memory_reserved(device) / GIB,
                "train/mem_reserved_peak": mod.max_memory_reserved(device) / GIB}
    rss = current_rss()  # the kernel's high-water mark can lag the current value
    return {"train/mem_rss": rss / GIB, "train/mem_rss_peak": max(rss, peak_rss()) / GIB}


def steady_start(n_steps: int) -> int:
    """First step of the steady state: a fifth of the run (1..100 steps) is warm-up."""
    return 1 + min(max(n_steps - 1, 0), max(1, min(n_steps // 5, 100)))


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """last / mean / min / max / steady-state mean of every numeric metric."""
    steady_from = steady_start(len(rows))
    out: dict[str, dict[str, float]] = {}
    for key in dict.fromkeys(k for row in rows for k in row):
        values = [row[key] for row in rows if isinstance(row.get(key), (int, float))]
        steady = [row[key] for row in rows
                  if row["train/iter"] >= steady_from and isinstance(row.get(key), (int, float))]
        if values:
            out[key] = {"last": values[-1], "mean": sum(values) / len(values),
                        "min": min(values), "max": max(values),
                        "steady_mean": sum(steady) / len(steady) if steady else values[-1]}
    return out


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def run_history(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the run as it stands: a resumed run appends from its checkpoint's step,
    so a row whose step is not past the previous one replaces the rows it repeats."""
    history: list[dict[str, Any]] = []
    for row in rows:
        while history and history[-1]["train/iter"] >= row["train/iter"]:
            history.pop()
        history.append(row)
    return history


class NullMetrics:
    """Metrics off: the loop's calls cost nothing; only config.json is written."""

    def __init__(self, outdir: Path, rank: int):
        self.outdir, self.rank = outdir, rank
        outdir.mkdir(parents=True, exist_ok=True)

    def write_config(self, config: dict[str, Any]) -> None:
        """Collective: every rank adds its hostname; rank 0 writes."""
        names = hostnames()
        if self.rank == 0:
            text = json.dumps({**config, "hostnames": names}, indent=2, default=str)
            (self.outdir / "config.json").write_text(text + "\n")

    def watch(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        pass

    def begin(self, total_steps: int, start_step: int = 0, tokens_seen: int = 0) -> None:
        pass

    def forward_done(self) -> None:
        pass

    def backward_done(self) -> None:
        pass

    def log_step(self, step: int, epoch: int, bidx: int, loss: torch.Tensor,
                 grad_norm: torch.Tensor, extra: dict[str, float] | None = None,
                 ) -> dict[str, Any] | None:
        return None

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


class Metrics(NullMetrics):
    """One rank's per-step rows; rank 0 adds progress, W&B, summary and plots."""

    def __init__(self, outdir: Path, rank: int, device: torch.device, facts: RunFacts, *,
                 health_every: int, progress: Progress, wandb: WandbRun | None,
                 histograms: Histograms, remeasure: Callable[[], flops.Peak]):
        super().__init__(outdir, rank)
        self.device, self.facts, self.health_every = device, facts, health_every
        self.progress, self.wandb, self.histograms = progress, wandb, histograms
        self.clock = StepClock(device)
        self.mfu = flops.MfuMeter(facts.flops_per_rank, flops.Peak(facts.peak_flops,
                                  facts.peak_source), remeasure)
        self.rows_path = outdir / f"metrics-{rank}.jsonl"
        self.rows: TextIO | None = None
        self.step, self.lr, self.tokens_seen = 0, 0.0, 0
        self.model: nn.Module | None = None
        self.grad_stats: torch.Tensor | None = None
        self.t_begin = time.perf_counter()

    def write_config(self, config: dict[str, Any]) -> None:
        super().write_config({**config, "derived": asdict(self.facts)})

    def watch(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Gradients are read in an optimizer step pre-hook: after clipping, before the
        update and zero_grad, without touching train_step."""
        self.model = model
        self.hook = optimizer.register_step_pre_hook(self._before_update)
        self.histograms.attach(model)

    def health_due(self, step: int) -> bool:
        return self.health_every > 0 and step % self.health_every == 0

    def _before_update(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        step = self.step + 1
        self.lr = float(optimizer.param_groups[0]["lr"])
        if self.health_due(step):
            grads = (p.grad for g in optimizer.param_groups for p in g["params"])
            self.grad_stats = tensor_stats((g for g in grads if g is not None), self.device)
        self.histograms.gradients(step)

    def begin(self, total_steps: int, start_step: int = 0, tokens_seen: int = 0) -> None:
        """`tokens_seen`: the resumed run's count, which later rows continue."""
        # Appended, never truncated: the folder is new, or resumed (see `run_history`).
        self.rows, self.step = self.rows_path.open("a"), start_step
        self.tokens_seen = tokens_seen
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
        self.clock.start()

    def forward_done(self) -> None:
        self.clock.forward_done()

    def backward_done(self) -> None:
        self.clock.backward_done()

    def _health(self, step: int) -> list[torch.Tensor]:
        if not self.health_due(step) or self.model is None:
            return []
        grads = self.grad_stats if self.grad_stats is not None else torch.full(
            (3,), float("nan"), device=self.device)
        self.grad_stats = None
        return [grads, tensor_stats(self.model.parameters(), self.device)]

    def log_step(self, step: int, epoch: int, bidx: int, loss: torch.Tensor,
                 grad_norm: torch.Tensor, extra: dict[str, float] | None = None,
                 ) -> dict[str, Any]:
        """`extra`: more columns for the row (the MoE metrics)."""
        health = self._health(step)
        scalars = [loss.detach().float().reshape(1), grad_norm.detach().float().reshape(1)]
        values = torch.cat([*scalars, *health]).tolist()  # the step's one host sync
        dt, dtf, dtb = self.clock.stop()
        self.tokens_seen += self.facts.tokens_per_step
        row = self.row(step, epoch, bidx, values[0], values[1], (dt, dtf, dtb))
        if health:
            row.update(zip(HEALTH_KEYS, values[2:], strict=True))
        row.update(memory_stats(self.device))
        row.update(extra or {})
        self.step = step
        self.rows.write(json.dumps(row) + "\n")
        self.rows.flush()
        self.progress.update(row)
        if self.wandb:
            self.wandb.log(row, step)
        self.histograms.flush(step, self.wandb)
        self.clock.start()
        return row

    def row(self, step: int, epoch: int, bidx: int, loss: float, grad_norm: float,
            times: tuple[float, float, float]) -> dict[str, Any]:
        f, (dt, dtf, dtb) = self.facts, times
        return {"train/iter": step, "train/epoch": epoch, "train/bidx": bidx,
                "train/loss": loss, "train/dt": dt, "train/dtf": dtf, "train/dtb": dtb,
                "train/tokens": f.tokens_per_step, "train/tokens_seen": self.tokens_seen,
                "train/tps": f.tokens_per_step / dt,
                "train/tps_per_gpu": f.tokens_per_step / dt / f.world_size,
                "train/tflops": f.flops_per_rank / dt / 1e12,
                "train/mfu": self.mfu(dt),
                "grad/norm_preclip": grad_norm, "opt/lr": self.lr}

    def timings(self) -> dict[str, float]:
        end = time.perf_counter()
        timings = {"setup_s": self.t_begin - _clock_origin[0], "train_s": end - self.t_begin,
                   "total_s": end - _clock_origin[0]}
        _clock_origin[0] = end
        return timings

    def finish(self) -> None:
        """summary.json, plots and the loss text plot (rank 0), then close W&B."""
        timings = self.timings()
        if self.rows is not None:
            self.rows.close()
        summary = None
        if self.rank == 0:
            summary = self.write_summary(timings)
        if self.wandb:
            self.wandb.finish(summary)
            self.wandb = None

    def write_summary(self, timings: dict[str, float]) -> dict[str, Any]:
        rows = run_history(read_rows(self.outdir / "metrics-0.jsonl"))
        summary = {"steps": len(rows), "tokens": rows[-1]["train/tokens_seen"] if rows else 0,
                   "steady_from_step": steady_start(len(rows)), "timings": timings,
                   **asdict(self.facts), "peak_flops": self.mfu.peak.flops,
                   "metrics": summarize(rows)}
        (self.outdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if rows:
            write_plots(rows, self.outdir / "plots")
            self.log_closing(rows, summary)
        return summary

    def log_closing(self, rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
        steady = summary["metrics"]
        logger.info("\n".join(text_plot([r["train/loss"] for r in rows], label="loss")))
        logger.info("done: %d steps, %s tokens, loss %.4f -> %.4f; steady %s tok/s, "
                    "MFU %.2f%%; setup %.1f s, train %.1f s; run folder %s",
                    summary["steps"], f"{summary['tokens']:,}", rows[0]["train/loss"],
                    rows[-1]["train/loss"], f"{steady['train/tps']['steady_mean']:,.0f}",
                    steady.get("train/mfu", {}).get("steady_mean", float("nan")),
                    summary["timings"]["setup_s"],
                    summary["timings"]["train_s"], self.outdir)

    def close(self) -> None:
        if self.rows is not None:
            self.rows.close()
        self.histograms.close()
        if self.model is not None:
            self.hook.remove()
        if self.wandb:
            self.wandb.finish(None)
            self.wandb = None


def run_facts(cfg: JobConfig, dims: ParallelDims, device: torch.device, model: nn.Module,
              build_model: Callable[[], nn.Module], world_size: int) -> RunFacts:
    """Global batch, parameters, counted FLOPs (per step and per rank) and the peak."""
    batch = cfg.train.batch_size * cfg.train.grad_accum_steps  # samples per dp rank per step
    seq, global_batch = cfg.data.seq_len, dims.global_batch_size(batch)
    count = flops.count_step_flops(build_model, batch, seq)
    peak = flops.peak_flops(device, run_dtype(cfg, device), peak_cache(cfg))
    return RunFacts(
        global_batch_size=global_batch, tokens_per_step=global_batch * seq,
        parameters=sum(p.numel() for p in model.parameters()),
        flops_per_step=count.flops * dims.dp_size,
        flops_per_rank=count.flops / (dims.tp * dims.pp),  # a pp rank runs its stages only
        flops_exact=count.exact, peak_flops=peak.flops, peak_source=peak.source,
        world_size=world_size, dp_size=dims.dp_size, tp=dims.tp)


def run_dtype(cfg: JobConfig, device: torch.device) -> torch.dtype:
    return torch_dtype(resolve_precision(cfg.parallel.dtype, device).dtype)


def peak_cache(cfg: JobConfig) -> Path:
    return Path(cfg.data.cache_dir).expanduser() if cfg.data.cache_dir else default_cache_dir()


def hostnames() -> list[str]:
    names: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return [str(n) for n in names]


def build_metrics(cfg: JobConfig, info: RankInfo, dims: ParallelDims, device: torch.device,
                  outdir: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                  build_model: Callable[[], nn.Module]) -> NullMetrics:
    """The rank's metrics (or the no-op when metrics are off), watching model and optimizer.
    W&B's run is created here, before training starts."""
    out = cfg.output
    if not out.metrics:
        return NullMetrics(outdir, info.rank)
    facts = run_facts(cfg, dims, device, model, build_model, info.world_size)
    wandb = WandbRun(outdir, cfg.to_dict() | {"derived": asdict(facts)}) \
        if out.wandb and info.is_main else None
    metrics = Metrics(outdir, info.rank, device, facts, health_every=out.health_every,
                      progress=Progress(out.log_every, enabled=info.is_main), wandb=wandb,
                      histograms=Histograms(outdir, info.rank, out.hist_every, out.hist),
                      remeasure=lambda: flops.peak_flops(device, run_dtype(cfg, device),
                                                         peak_cache(cfg), remeasure=True))
    metrics.watch(model, optimizer)
    return metrics
