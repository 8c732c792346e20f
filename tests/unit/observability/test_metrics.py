"""Metric building blocks: health statistics, step clock, summary, progress, plots, knobs."""

from __future__ import annotations

import io
import json
import logging
import math
import re
import statistics
import sys
import time
import warnings

import pytest
import torch

from loom.config import ConfigError, config_from_flags, parse_args
from loom.observability.metrics import (
    StepClock,
    memory_stats,
    steady_start,
    summarize,
    tensor_stats,
)
from loom.observability.metrics.health import max_abs
from loom.observability.plots import PLOTS, write_plots
from loom.observability.profiling import torch_profile
from loom.observability.progress import Progress, auto_every, text_plot
from loom.observability.tracking import layer_of

CPU = torch.device("cpu")


def test_tensor_stats_match_a_flat_reference():
    tensors = [torch.randn(7, 5), torch.randn(11).to(torch.bfloat16), torch.empty(0),
               torch.tensor([-9.5, 2.0])]
    flat = torch.cat([t.float().flatten() for t in tensors])
    norm, max_abs, nonfinite = tensor_stats(tensors, CPU).tolist()
    assert norm == pytest.approx(flat.norm().item(), rel=1e-5)
    assert max_abs == 9.5 and nonfinite == 0


def test_tensor_stats_count_tensors_holding_nan_or_inf():
    tensors = [torch.tensor([1.0, math.nan]), torch.tensor([math.inf, 0.0]), torch.ones(3)]
    _, max_abs, nonfinite = tensor_stats(tensors, CPU).tolist()
    assert nonfinite == 2 and math.isnan(max_abs)


@pytest.mark.parametrize("per_tensor", [True, False])
def test_max_abs_per_tensor_and_foreach_agree(per_tensor: bool):
    """The CPU's per-tensor extremes and the accelerators' foreach inf-norm, both run here."""
    tensors = [torch.tensor([-3.0, 2.0]), torch.tensor([1.0, math.nan]),
               torch.tensor([-math.inf, 0.0]), torch.tensor([0.5, -7.25]).to(torch.bfloat16)]
    got = max_abs(tensors, per_tensor=per_tensor)
    assert got.dtype == torch.float32
    assert got[0] == 3.0 and math.isnan(got[1]) and got[2] == math.inf and got[3] == 7.25


def test_step_clock_splits_forward_and_backward():
    clock = StepClock(CPU)
    time.sleep(0.05)
    clock.forward_done()
    time.sleep(0.03)
    dt, dtf, dtb = clock.stop()()
    assert dtf >= 0.05 and dtb >= 0.03, (dtf, dtb)  # each lap holds at least its sleep
    assert dt == pytest.approx(dtf + dtb, rel=1e-9)


def test_summary_reports_last_mean_min_max_and_steady_mean():
    losses = [9.0, 7.0, 5.0, 4.0, 3.5, 3.0, 2.9, 2.8, 2.7, 2.6]
    rows = [{"train/iter": i + 1, "train/loss": v} for i, v in enumerate(losses)]
    for row in rows[::3]:
        row["grad/norm"] = float(row["train/iter"])  # a metric only some steps carry
    loss = summarize(rows)["train/loss"]
    first = steady_start(len(rows))
    assert 1 < first <= 5
    assert loss == {"last": 2.6, "mean": pytest.approx(statistics.mean(losses)), "min": 2.6,
                    "max": 9.0, "steady_mean": pytest.approx(statistics.mean(losses[first - 1:]))}
    assert summarize(rows)["grad/norm"]["max"] == 10.0


def row(step: int) -> dict:
    return {"train/iter": step, "train/loss": 10.0 / step, "train/tps": 1000.0,
            "train/mfu": 12.5, "train/dt": 0.1}


def test_progress_off_a_terminal_logs_every_n_steps_plus_first_and_last(caplog):
    progress = Progress(every=0, enabled=True, stream=io.StringIO())
    progress.begin(95)
    with caplog.at_level(logging.INFO, logger="loom"):
        for step in range(1, 96):
            progress.update(row(step))
    steps = [int(r.getMessage().split()[1].split("/")[0]) for r in caplog.records]
    assert auto_every(95) == 5 and steps == [1, *range(5, 96, 5)]
    assert "loss 0.1053" in caplog.records[-1].getMessage()
    assert "eta 0:00:00" in caplog.records[-1].getMessage()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_redraws_one_line():
    stream = Terminal()
    progress = Progress(every=4, enabled=True, stream=stream)
    progress.begin(10)
    for step in range(1, 11):
        progress.update(row(step))
    kept = stream.getvalue().count("\n")
    assert stream.getvalue().count("\r") == 10 and kept == 4  # steps 1, 4, 8, 10


def test_progress_is_silent_when_disabled(caplog):
    stream = io.StringIO()
    progress = Progress(every=1, enabled=False, stream=stream)
    progress.begin(3)
    with caplog.at_level(logging.INFO, logger="loom"):
        progress.update(row(1))
    assert not caplog.records and not stream.getvalue()


def test_text_plot_draws_a_falling_curve_between_its_extremes():
    values = [10.0 - i for i in range(8)] + [math.nan]
    lines = text_plot(values, label="loss", height=8, width=60)
    assert lines[0] == "loss over 9 steps" and len(lines) == 10
    grid = [line.split("|", 1)[1] for line in lines[1:-1]]
    assert [g.index("*") for g in grid] == list(range(8))  # one point per row, left to right
    assert lines[1].startswith("10.00") and lines[8].lstrip().startswith("3.000")


def test_text_plot_resamples_long_series_to_its_width():
    lines = text_plot([float(i) for i in range(1000)], label="x", width=40)
    assert max(len(line.split("|", 1)[-1]) for line in lines[1:-1]) <= 40


def test_memory_on_cpu_is_process_rss():
    stats = memory_stats(CPU)
    assert 0 < stats["train/mem_rss"] <= stats["train/mem_rss_peak"]


def test_plots_are_readable_pngs(tmp_path):
    from matplotlib.image import imread

    rows = [{**row(s), "train/tokens_seen": 512 * s, "train/mem_rss": 0.5 + s / 100,
             "train/mem_rss_peak": 0.6} for s in range(1, 6)]
    written = write_plots(rows, tmp_path)
    assert sorted(p.name for p in written) == sorted(PLOTS)
    for path in written:
        image = imread(path)
        assert image.shape[0] > 100 and image.shape[1] > 100
        assert image.std() > 0.01  # something was drawn


def test_plots_without_data_draw_no_empty_legend(tmp_path):
    """A 1-step run has no rank timings: matplotlib would warn of a legend with no curves."""
    rows = [{"train/iter": 1, "train/tokens_seen": 16, "train/loss": 5.0}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(write_plots(rows, tmp_path)) == len(PLOTS)


def test_layer_names_group_parameters_per_block():
    assert layer_of("layers.3.attention.wq.weight", "layers") == "layer3"
    assert layer_of("layers.0._checkpoint_wrapped_module.ffn_norm.weight", "layers") == "layer0"
    assert layer_of("tok_embeddings.weight", "layers") == "tok_embeddings"


@pytest.mark.parametrize(("environ", "message"), [
    ({"LOOM_HEALTH_EVERY": "often"}, "LOOM_HEALTH_EVERY must be an integer"),
    ({"LOOM_LOG_EVERY": "-1"}, "--log-every ($LOOM_LOG_EVERY) must be >= 0"),
    ({"LOOM_HIST": "logits,weights"}, "unknown histogram kind(s) weights"),
    ({"LOOM_METRICS": "maybe"}, "LOOM_METRICS must be 0 or 1"),
])
def test_bad_measurement_knobs_are_config_errors(environ, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_flags({}, environ)


def test_measurement_knobs_reach_the_config():
    cfg = config_from_flags({}, {"LOOM_HEALTH_EVERY": "5", "LOOM_HIST_EVERY": "2",
                                 "LOOM_HIST": "grads", "LOOM_METRICS": "0", "LOOM_LOG_EVERY": "7"})
    o = cfg.output
    assert (o.health_every, o.hist_every, o.hist, o.metrics, o.log_every) == (5, 2, "grads",
                                                                             False, 7)


@pytest.mark.parametrize(("flag", "module", "extra"), [
    ("--pyinstrument-profiler", "pyinstrument", "profile"), ("--wandb", "wandb", "wandb"),
    ("--float8 tensorwise", "torchao", "float8"), ("--tensorboard", "tensorboard", "tensorboard")])
def test_flags_needing_a_missing_package_fail_in_one_line(monkeypatch, flag, module, extra):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ConfigError, match=rf"{flag} needs the {module} package: "
                                          rf"pip install 'loom\[{extra}\]'"):
        parse_args(flag.split())


@pytest.mark.parametrize("steps", [1, 3, 10])
def test_torch_profile_writes_a_trace_even_for_short_runs(tmp_path, steps):
    with torch_profile(tmp_path, 0, steps) as prof:
        for _ in range(steps):
            torch.randn(32, 32) @ torch.randn(32, 32)
            prof.step()
    trace = json.loads((tmp_path / "profile" / "trace-rank0.json").read_text())
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])


@pytest.mark.parametrize("verbose", [False, True])
def test_torch_profile_hides_kineto_start_stop_lines_unless_verbose(tmp_path, capfd, verbose):
    with torch_profile(tmp_path, 0, 3, verbose=verbose) as prof:
        for _ in range(3):
            torch.randn(8, 8) @ torch.randn(8, 8)
            prof.step()
    err = capfd.readouterr().err
    assert ("profiler_start" in err) == verbose, err


class FakeEvent:
    """A CUDA event at a fixed device time (ms); `synchronize` is recorded."""

    def __init__(self, ms: float, waits: list[float]):
        self.ms, self.waits = ms, waits

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.ms - self.ms

    def synchronize(self) -> None:
        self.waits.append(self.ms)


def test_event_clock_splits_laps_ending_at_forward_marks(monkeypatch):
    """CUDA's clock: marks at start, each forward end and stop; dtf sums the laps that end
    at a forward mark, read (one wait, on the last event) only when the times are asked."""
    waits: list[float] = []
    times = iter([0.0, 30.0, 50.0, 90.0, 130.0])  # start, fwd 1, (bwd), fwd 2, stop
    monkeypatch.setattr(StepClock, "_event", staticmethod(lambda: FakeEvent(next(times),
                                                                            waits)))
    clock = StepClock(CPU)
    clock.events = True
    clock.start()
    clock.forward_done()
    clock.marks.append(FakeEvent(next(times), waits))  # a lap that is not a forward
    clock.forward_done()
    laps = clock.stop()
    assert waits == [], "stop() reads nothing"
    dt, dtf, dtb = laps()
    assert waits == [130.0]
    assert (dt, dtf, dtb) == pytest.approx((0.130, 0.030 + 0.040, 0.060))
