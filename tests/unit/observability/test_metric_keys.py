"""The specification's per-step keys that need no process group: logits tracking, input
range, exact valid-token counts, the console's memory figure, histogram and profiler knobs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loom.config import ConfigError, config_from_flags, parse_args
from loom.models.spec import FAMILY_ATTR
from loom.observability.metrics.health import LogitsTracker, exact_float_parts, input_range
from loom.observability.profiling import ProfileOptions, profile_schedule
from loom.observability.progress import format_progress
from loom.observability.tracking import Histograms, histogram


class Head(nn.Module):
    """A model whose head is named like loom's: `output`, marked as the Llama family's (the
    tracker finds the head through the family's spec, as for a built model)."""

    def __init__(self) -> None:
        super().__init__()
        self.output = nn.Linear(4, 8)
        setattr(self, FAMILY_ATTR, "llama")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(x)


def test_logits_tracker_folds_micro_batches_and_skips_evaluation():
    model, tracker = Head(), LogitsTracker()
    tracker.attach(model)
    first = model(torch.randn(3, 4))
    with torch.no_grad():
        model(torch.full((3, 4), 1e6))  # evaluation: not recorded
    second = model(torch.randn(3, 4))
    max_abs, nonfinite = tracker.take().tolist()
    assert max_abs == pytest.approx(float(torch.cat([first, second]).detach().abs().max()))
    assert nonfinite == 0 and tracker.take() is None, "taken once, then a fresh step"
    with torch.no_grad():
        model.output.bias[0] = float("nan")
    model(torch.randn(2, 4))
    max_abs, nonfinite = tracker.take().tolist()
    assert nonfinite == 2 and max_abs != max_abs, "a NaN logit makes max |logit| NaN"
    tracker.close()
    model(torch.randn(2, 4))
    assert tracker.take() is None


def test_input_range_and_exact_counts():
    batches = [{"input": torch.tensor([[5, 9, 7]])}, {"input": torch.tensor([[3, 8, 4]])}]
    big = [{"input": torch.tensor([[2**24 + 1, 2**25 + 3]])}]
    assert input_range(batches, torch.device("cpu")).tolist() == [0, 3, 0, 9]
    assert input_range(big, torch.device("cpu")).tolist() == [1, 1, 2, 3], "exact past 2**24"
    count = torch.tensor(2**24 * 3 + 12345, dtype=torch.int64)
    hi, lo = exact_float_parts(count).tolist()
    assert int(hi) * 2**24 + int(lo) == 2**24 * 3 + 12345
    assert float(count.float()) != 2**24 * 3 + 12345, "a single float32 would round it"


def test_console_line_shows_memory():
    row = {"train/iter": 3, "train/loss": 6.5, "train/tps": 1000.0, "train/mfu": 1.0,
           "train/dt": 0.1}
    assert "mem" not in format_progress(row, 10, 1.0)
    assert "mem  1.50 GiB" in format_progress({**row, "train/mem_rss_peak": 1.5}, 10, 1.0)
    assert "mem 12.25 GiB" in format_progress({**row, "train/mem_alloc_peak": 12.25}, 10, 1.0)


def test_histogram_bins_and_samples():
    x = torch.arange(1000.0)
    assert len(histogram(x, bins=16)) == 2 + 16
    sampled = histogram(x, bins=10, samples=100)
    assert sampled[2:].sum() == 100 and sampled[0] == 0


def test_histogram_layers_select_blocks(tmp_path):
    hist = Histograms(tmp_path, 0, every=1, kinds="grads,acts", layers="0,2")
    assert [hist.layer_selected(i) for i in "0123"] == [True, False, True, False]
    assert Histograms(tmp_path, 0, every=1, kinds="acts").layer_selected("7")


def test_profile_schedule_follows_the_knobs_and_shrinks_for_short_runs():
    cfg = parse_args(["--profile-wait", "1", "--profile-warmup", "0", "--profile-active", "2",
                      "--profile-repeat", "3", "--profile-memory", "--profile-rank0-only"])
    options = ProfileOptions.from_config(cfg.output)
    assert (options.repeat, options.memory, options.shapes) == (3, True, False)
    assert cfg.output.profile_rank0_only
    assert profile_schedule(10, options) == (1, 0, 2)
    assert profile_schedule(2, ProfileOptions()) == (0, 1, 1)


@pytest.mark.parametrize(("environ", "message"), [
    ({"LOOM_HIST_BINS": "0"}, "--hist-bins ($LOOM_HIST_BINS) must be >= 1"),
    ({"LOOM_HIST_SAMPLES": "-1"}, "--hist-samples ($LOOM_HIST_SAMPLES) must be >= 0"),
    ({"LOOM_HIST_LAYERS": "0,x"}, "--hist-layers '0,x'"),
    ({"LOOM_HIST": "attn,weights"}, "unknown histogram kind(s) weights"),
])
def test_bad_histogram_knobs_are_config_errors(environ, message):
    with pytest.raises(ConfigError) as err:
        config_from_flags({}, environ)
    assert message in str(err.value)


def test_knobs_reach_the_config():
    cfg = config_from_flags({}, {"LOOM_HIST_BINS": "16", "LOOM_HIST_SAMPLES": "100",
                                 "LOOM_HIST_LAYERS": "0, 2", "LOOM_TRACK_LOGITS": "1"})
    o = cfg.output
    assert (o.hist_bins, o.hist_samples, o.hist_layers, o.track_logits) == (16, 100, "0,2", True)
    with pytest.raises(ConfigError, match="--profile-active must be >= 1"):
        parse_args(["--profile-active", "0"])
