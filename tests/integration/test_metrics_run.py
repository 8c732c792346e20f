"""Real `loom train` runs and the run folder they leave: the spec's per-step keys with finite
values on every rank, a positive MFU, summary, plots, a short console, profilers, W&B
(through a recording stand-in), histograms, health cadence, and metrics switched off."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from loom.numerics.precision import resolve_precision
from loom.observability.metrics import read_rows
from tests.compare import rows
from tests.harness import REPO, run_ranks

SPEC_KEYS = (
    "train/iter", "train/epoch", "train/bidx", "train/loss", "train/dt", "train/dtf",
    "train/dtb", "train/tokens", "train/tokens_seen", "train/tps", "train/tps_per_gpu",
    "train/tflops", "train/mfu", "grad/norm_preclip", "grad/norm", "grad/max_abs",
    "grad/nonfinite", "param/norm", "param/max_abs", "param/nonfinite", "opt/lr",
    "train/mem_rss", "train/mem_rss_peak", "labels/valid", "input/min", "input/max",
    "input/iter", "opt/iter")
TIMING_SPREAD = tuple(f"train/{t}_{s}" for s in ("min", "max", "std") for t in ("dt", "dtf", "dtb"))
"""Cross-rank spread of the step's timings, in the rows of the logging steps."""
LOGITS_KEYS = ("logits/max_abs", "logits/nonfinite")
HEALTH_KEYS = [k for k in SPEC_KEYS if k.startswith(("grad/n", "grad/m", "param/"))
               and k != "grad/norm_preclip"]
MEMORY_KEYS = ("train/mem_rss", "train/mem_rss_peak")
PLOTS = {"loss.png", "throughput.png", "mfu.png", "memory.png", "ranks.png"}
FAKE_WANDB = Path(__file__).parent / "fake_wandb"


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory) -> tuple[Path, list[str], Path]:
    """The acceptance run: 2 ranks, debug model, random data, 10 steps (cwd = a fresh dir),
    at the default --dtype auto (fp32 on CPUs without native bf16, where bf16 is 10-50x
    slower), so config.json's record of that choice is checked too."""
    cwd = tmp_path_factory.mktemp("dp2")
    job = run_ranks(2, ["-m", "loom", "train", "--model", "debug", "--dataset", "random",
                        "--max-steps", "10", "--outdir", "run"], timeout=900, cwd=cwd,
                    env={"LOOM_CACHE_DIR": str(cwd / "cache")})
    assert job.ok, job.describe()
    assert not job.ranks[1].stdout
    return cwd / "run", job.ranks[0].stdout.splitlines(), cwd


@pytest.mark.multirank
def test_every_row_has_the_spec_keys_with_finite_values(dp2_run):
    outdir, _, _ = dp2_run
    config = json.loads((outdir / "config.json").read_text())
    per_rank = config["derived"]["flops_per_rank"]
    for rank in (0, 1):
        table = rows(outdir, rank)
        assert [r["train/iter"] for r in table] == list(range(1, 11))
        for r in table:
            missing = [k for k in SPEC_KEYS if k not in r]
            assert not missing, missing
            assert r["train/mfu"] is None or 0 < r["train/mfu"] <= 100, r  # None: above 100%
            assert all(math.isfinite(r[k]) for k in SPEC_KEYS if k != "train/mfu"), r
            assert r["train/tokens"] == 2 * 256 and r["train/tokens_seen"] == 512 * r["train/iter"]
            assert r["train/dt"] == pytest.approx(r["train/dtf"] + r["train/dtb"])
            assert r["train/tflops"] * 1e12 * r["train/dt"] == pytest.approx(per_rank)
            assert r["grad/nonfinite"] == 0 and r["param/nonfinite"] == 0
            assert r["labels/valid"] == 2 * 256 and 0 <= r["input/min"] <= r["input/max"] < 32000
            assert r["input/iter"] == r["opt/iter"] == r["train/iter"]
            assert not any(k in r for k in LOGITS_KEYS), "logits only under --track-logits"
            for t in ("dt", "dtf", "dtb"):  # every step is a logging step at 10 steps
                spread = [r[f"train/{t}_{s}"] for s in ("min", "max", "std")]
                assert spread[0] <= r[f"train/{t}"] <= spread[1] and spread[2] >= 0, r
    losses = [[r["train/loss"] for r in rows(outdir, k)] for k in (0, 1)]
    assert losses[0] == losses[1], "the reported loss is the dp average on every rank"


@pytest.mark.multirank
def test_run_folder_config_summary_and_plots(dp2_run):
    from matplotlib.image import imread

    outdir, _, cwd = dp2_run
    written = {p.name for p in cwd.iterdir()}  # the peak is cached only if measured clean
    assert written in ({"run"}, {"cache", "run"}), f"wrote outside --outdir: {written}"
    config = json.loads((outdir / "config.json").read_text())
    derived = config["derived"]
    assert len(config["hostnames"]) == 2 and config["mesh"]["dp_shard"] == 2
    assert derived["flops_per_step"] == pytest.approx(2 * derived["flops_per_rank"])
    assert derived["global_batch_size"] == 2 and derived["flops_exact"]
    expected = resolve_precision("auto", torch.device("cpu"))
    assert config["precision"] == vars(expected) and config["parallel"]["dtype"] == expected.dtype
    summary = json.loads((outdir / "summary.json").read_text())
    table = rows(outdir)
    assert summary["steps"] == 10 and summary["tokens"] == 5120
    loss = summary["metrics"]["train/loss"]
    assert loss["last"] == table[-1]["train/loss"] and loss["max"] >= loss["steady_mean"]
    t = summary["timings"]
    assert min(t["setup_s"], t["train_s"]) > 0
    assert t["total_s"] >= t["setup_s"] + t["train_s"]
    assert {p.name for p in (outdir / "plots").iterdir()} == PLOTS
    for name in PLOTS:
        assert imread(outdir / "plots" / name).shape[2] in (3, 4)


@pytest.mark.multirank
def test_console_is_short_with_progress_and_a_loss_plot(dp2_run):
    _, lines, _ = dp2_run
    assert len(lines) <= 40, "\n".join(lines)
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 10 and steps[-1].startswith("step 10/10")
    assert "loss over 10 steps" in lines
    assert any(line.startswith("done: 10 steps") for line in lines)


SMALL = ["-m", "loom", "train", "--model", "debug", "--dataset", "random", "--vocab-size", "512",
         "--seq-len", "64", "--max-steps", "8", "--fp32"]


@pytest.mark.multirank
def test_profilers_histograms_wandb_and_health_cadence(tmp_path):
    log = tmp_path / "wandb-calls.jsonl"
    schedule = ["--profile-wait", "1", "--profile-warmup", "1", "--profile-active", "2",
                "--profile-repeat", "2", "--profile-shapes"]
    job = run_ranks(1, [*SMALL, "--outdir", "run", "--profile", *schedule,
                        "--pyinstrument-profiler", "--wandb", "--log-every", "4"],
                    timeout=900, cwd=tmp_path,
                    env={"PYTHONPATH": f"{FAKE_WANDB}:{REPO / 'src'}:{REPO}",
                         "FAKE_WANDB_LOG": str(log),
                         "LOOM_HIST_EVERY": "2", "LOOM_HEALTH_EVERY": "3",
                         "LOOM_HIST": "logits,grads,acts,attn,ffn", "LOOM_HIST_LAYERS": "0,2",
                         "LOOM_HIST_BINS": "16", "LOOM_HIST_SAMPLES": "1000",
                         "LOOM_CACHE_DIR": str(tmp_path / "cache")})
    assert job.ok, job.describe()
    run = tmp_path / "run"
    trace = json.loads((run / "profile" / "trace-rank0.json").read_text())
    assert trace["traceEvents"] and "aten::mm" in (run / "profile" / "ops-rank0.txt").read_text()
    assert (run / "profile" / "trace-rank0-cycle1.json").exists(), "--profile-repeat 2"
    assert any("Input Dims" in e.get("args", {}) for e in trace["traceEvents"]), "shapes"
    assert "fit" in (run / "pyinstrument-rank0.txt").read_text()
    assert (run / "pyinstrument-rank0.html").stat().st_size > 0

    table = rows(run)
    assert [r["train/iter"] for r in table if "grad/norm" in r] == [3, 6]
    assert all(all(k in r for k in HEALTH_KEYS) == (r["train/iter"] % 3 == 0) for r in table)
    stdout = job.ranks[0].stdout.splitlines()
    shown = [line.split()[1] for line in stdout if line.startswith("step")]
    assert shown == ["1/8", "4/8", "8/8"]

    hist = read_rows(run / "histograms-0.jsonl")
    assert [h["step"] for h in hist] == [2, 4, 6, 8]
    for h in hist:
        assert set(h["histograms"]) == {"logits", *(f"{kind}/layer{i}" for i in (0, 2)
                                                    for kind in ("acts", "attn", "ffn"))}
        counts = h["histograms"]["logits"]["counts"]
        assert len(counts) == 16 and sum(counts) == 1000  # 1000 of the 64 x 512 logits
        assert set(h["grad_norms"]) == {"tok_embeddings", "norm", "output", "layer0", "layer2"}

    calls = read_rows(log)
    assert calls[0][0] == "init" and "derived" in calls[0][4]
    assert (tmp_path / calls[0][3]).resolve() == run.resolve()  # W&B files in the run folder
    logged = [c for c in calls if c[0] == "log"]
    assert [c[1] for c in logged if "train/loss" in c[2]] == list(range(1, 9))
    assert [c[1] for c in logged if "hist/logits" in c[2]] == [2, 4, 6, 8]
    assert [c[0] for c in calls[-2:]] == ["summary", "finish"]


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in `folder`, read back as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep them all
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


@pytest.mark.multirank
def test_tensorboard_event_files_hold_every_scalar_of_the_rows(tmp_path):
    """The acceptance run: 20 steps with --tensorboard; every numeric column of every JSONL
    row is a scalar at its step (float32 in the event file), and nothing else is."""
    job = run_ranks(1, [*SMALL, "--max-steps", "20", "--log-every", "5", "--outdir", "run",
                        "--tensorboard"], timeout=900, cwd=tmp_path,
                    env={"LOOM_CACHE_DIR": str(tmp_path / "cache")})
    assert job.ok, job.describe()
    table = rows(tmp_path / "run")
    assert [r["train/iter"] for r in table] == list(range(1, 21))
    expected: dict[str, list[tuple[int, float]]] = {}
    for r in table:
        for key, value in r.items():
            if value is not None:
                expected.setdefault(key, []).append((r["train/iter"], value))
    scalars = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    assert set(scalars) == set(expected)
    for key, points in expected.items():
        assert [s for s, _ in scalars[key]] == [s for s, _ in points], key
        assert [v for _, v in scalars[key]] == pytest.approx([v for _, v in points],
                                                             rel=1e-6, nan_ok=True), key


@pytest.mark.multirank
def test_logits_tracking_profile_on_rank_0_and_timing_spread_at_logging_steps(tmp_path):
    job = run_ranks(2, [*SMALL, "--max-steps", "4", "--log-every", "2", "--outdir", "run",
                        "--track-logits", "--profile", "--profile-rank0-only",
                        "--profile-wait", "0", "--profile-warmup", "0", "--profile-active", "1"],
                    timeout=900, cwd=tmp_path, env={"LOOM_CACHE_DIR": str(tmp_path / "cache")})
    assert job.ok, job.describe()
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "profile").iterdir()) == ["ops-rank0.txt",
                                                                   "trace-rank0.json"]
    for rank in (0, 1):
        table = rows(run, rank)
        for r in table:
            logging = r["train/iter"] in (1, 2, 4)  # health and memory: logging rows only
            missing = [k for k in (*SPEC_KEYS, *LOGITS_KEYS) if k not in r
                       and (logging or k not in (*HEALTH_KEYS, *MEMORY_KEYS))]
            assert not missing, missing
            assert logging or not any(k in r for k in (*HEALTH_KEYS, *MEMORY_KEYS)), r
            assert r["logits/nonfinite"] == 0 and 0 < r["logits/max_abs"] < 1e3
            assert r["labels/valid"] == 2 * 64 and r["input/iter"] == r["train/iter"]
        spread = [r["train/iter"] for r in table if all(k in r for k in TIMING_SPREAD)]
        assert spread == [1, 2, 4], "the logging steps: first, every 2nd, last"
    assert [r["train/dt_max"] for r in rows(run, 0) if "train/dt_max" in r] == [
        r["train/dt_max"] for r in rows(run, 1) if "train/dt_max" in r], "one gather, shared"
    console = [line for line in job.ranks[0].stdout.splitlines() if line.startswith("step")]
    assert all(" mem " in line and "GiB" in line for line in console), console


@pytest.mark.multirank
def test_metrics_off_writes_only_the_config(tmp_path):
    job = run_ranks(1, [*SMALL, "--outdir", "run"], timeout=600, cwd=tmp_path,
                    env={"LOOM_METRICS": "0"})
    assert job.ok, job.describe()
    written = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert written == [".lock", ".loom-run", "config.json"], written  # flock file, marker
    assert not any(line.startswith("step") for line in job.ranks[0].stdout.splitlines())
