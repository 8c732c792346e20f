"""Checkpoint/resume, gradient accumulation and failing fast (fp32, gloo, CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from loom.checkpoint.checkpointer import storage_writer
from loom.checkpoint.format import METADATA, TensorReader
from loom.checkpoint.layout import complete_checkpoints
from tests.compare import column, rows
from tests.harness import REPO, Process, rank_env, run_ranks, start_process

COMMON = ["--model", "debug", "--dataset", "random", "--vocab-size", "512", "--seq-len", "64",
          "--fp32", "--seed", "11", "--lr", "1e-3", "--warmup-steps", "15"]
"""Warmup spans the resume point, so the LR scheduler's state must come back too."""


def job(world: int, runs: list[list[str]]) -> None:
    result = run_ranks(world, ["tests/workers/checkpoint_worker.py", json.dumps(runs)], timeout=900)
    assert result.ok, result.describe()


def straight_and_resumed(root: Path, name: str, flags: list[str]) -> list[list[str]]:
    base = [*COMMON, *flags]
    resumed = [*base, "--checkpoint-interval", "5", "--keep-checkpoints", "3",
               "--outdir", str(root / f"{name}-resumed")]
    return [[*base, "--max-steps", "20", "--outdir", str(root / f"{name}-straight")],
            [*resumed, "--max-steps", "10"],
            [*resumed, "--max-steps", "20", "--resume"]]


def assert_same_state(a: Path, b: Path) -> None:
    """Parameters and every AdamW state tensor (step, exp_avg, exp_avg_sq) bit for bit."""
    torch.testing.assert_close(torch.load(a / "params.pt"), torch.load(b / "params.pt"),
                               rtol=0, atol=0)
    optim_a, optim_b = torch.load(a / "optim.pt"), torch.load(b / "optim.pt")
    assert optim_a["state"].keys() == optim_b["state"].keys() != set()
    torch.testing.assert_close(optim_a["state"], optim_b["state"], rtol=0, atol=0)


def test_the_pickle_free_format_round_trips_and_refuses_objects(tmp_path: Path) -> None:
    """Raw tensor bytes and JSON metadata: every dtype and shape loom saves comes back bit
    for bit; no `.metadata` pickle is written; a non-tensor entry is refused on save."""
    state = {"f32": torch.randn(3, 4), "bf16": torch.randn(5).bfloat16(),
             "step": torch.tensor(7.0), "ids": torch.arange(6).view(2, 3),
             "mask": torch.tensor([True, False]), "empty": torch.empty(0, 3)}
    dcp.save(state, storage_writer=storage_writer(tmp_path / "ok"), no_dist=True)
    assert sorted(p.name for p in (tmp_path / "ok").iterdir()) == ["__0_0.distcp", METADATA]
    loaded = {name: torch.zeros_like(value) for name, value in state.items()}
    dcp.load(loaded, storage_reader=TensorReader(tmp_path / "ok"), no_dist=True)
    for name, value in state.items():
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), name
    with pytest.raises(CheckpointException, match="state entry lr is not a tensor"):
        dcp.save({"w": torch.ones(2), "lr": 0.1}, storage_writer=storage_writer(
            tmp_path / "object"), no_dist=True)


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("resume")
    job(2, [*straight_and_resumed(root, "dp2", ["--batch-size", "2"]),
            [*COMMON, "--batch-size", "2", "--max-steps", "10", "--outdir", str(root / "dp2-10")]])
    step10 = str(root / "dp2-resumed" / "checkpoints" / "step-10")
    job(4, [[*COMMON, "--batch-size", "1", "--max-steps", "10", "--resume", step10,
             "--outdir", str(root / "dp4-loaded")],
            [*COMMON, "--batch-size", "1", "--max-steps", "20", "--resume", step10,
             "--outdir", str(root / "dp4")],
            [*COMMON, "--batch-size", "2", "--max-steps", "12", "--resume", step10,
             "--outdir", str(root / "dp4-batch8")]])
    return root


def assert_resumed_exactly(root: Path, layout: str) -> None:
    straight = column(root / f"{layout}-straight")
    resumed = column(root / f"{layout}-resumed")
    assert sorted(resumed) == list(range(1, 21))
    for step in range(11, 21):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-6, abs=0), step
    assert_same_state(root / f"{layout}-straight", root / f"{layout}-resumed")
    kept = [p.name for p in complete_checkpoints(root / f"{layout}-resumed")]
    assert kept == ["step-10", "step-15", "step-20"]


@pytest.mark.multirank
def test_resume_continues_exactly(resume_runs: Path) -> None:
    assert_resumed_exactly(resume_runs, "dp2")


@pytest.mark.multirank
@pytest.mark.slow  # tp's checkpoints also move between layouts in test_custom_family.py
def test_resume_continues_exactly_at_tp2(tmp_path: Path) -> None:
    job(2, straight_and_resumed(tmp_path, "tp2", ["--batch-size", "4", "--tp", "2"]))
    assert_resumed_exactly(tmp_path, "tp2")


@pytest.mark.multirank
def test_resume_on_a_different_dp_degree(resume_runs: Path) -> None:
    assert_same_state(resume_runs / "dp2-10", resume_runs / "dp4-loaded")
    straight, resharded = column(resume_runs / "dp2-straight"), column(resume_runs / "dp4")
    assert sorted(resharded) == list(range(11, 21))
    for step in range(11, 21):
        assert resharded[step] == pytest.approx(straight[step], rel=1e-5, abs=0), step


@pytest.mark.multirank
def test_resume_with_another_global_batch_continues_the_counts_and_settings(
        resume_runs: Path) -> None:
    """2 ranks x 2 samples saved step 10; 4 ranks x 2 samples continue: tokens_seen goes on
    from the saved count, and the saved --checkpoint-interval 5 / --keep-checkpoints 3 hold."""
    folder = resume_runs / "dp4-batch8"
    saved = 10 * 4 * 64
    assert [(r["train/iter"], r["train/tokens_seen"]) for r in rows(folder)] == [
        (11, saved + 8 * 64), (12, saved + 2 * 8 * 64)]
    (latest,) = complete_checkpoints(folder)
    loop = json.loads((latest / "loop.json").read_text())
    assert (latest.name, loop["tokens_seen"], loop["samples_seen"]) == ("step-12", 3584, 56)
    assert loop["settings"]["checkpoint_interval"] == 5
    assert loop["settings"]["keep_checkpoints"] == 3
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["tokens"] == 3584


@pytest.mark.multirank
def test_gradient_accumulation_equals_the_large_batch(tmp_path: Path) -> None:
    """Reduced once a step (the default) or after every micro-batch (`--accum-reduce
    micro-batch`): the same losses and weights as one batch four times as large."""
    base = [*COMMON, "--max-steps", "5"]
    accum = [*base, "--batch-size", "1", "--grad-accum-steps", "4"]
    job(2, [[*base, "--batch-size", "4", "--outdir", str(tmp_path / "big")],
            [*accum, "--outdir", str(tmp_path / "step")],
            [*accum, "--accum-reduce", "micro-batch", "--outdir", str(tmp_path / "micro")]])
    big = column(tmp_path / "big")
    params = torch.load(tmp_path / "big" / "params.pt")
    for run in ("step", "micro"):
        losses = column(tmp_path / run)
        assert big.keys() == losses.keys() == set(range(1, 6)), run
        for step, value in big.items():
            assert losses[step] == pytest.approx(value, rel=1e-5, abs=0), (run, step)
        for name, value in params.items():
            torch.testing.assert_close(torch.load(tmp_path / run / "params.pt")[name], value,
                                       rtol=0, atol=1e-5, msg=f"{run}: {name}")


def train_process(outdir: Path, *flags: str) -> Process:
    argv = [sys.executable, "-m", "loom", "train", *COMMON, "--batch-size", "1",
            "--outdir", str(outdir), *flags]
    return start_process(argv, rank_env(0, 1, 29400, None))


@pytest.mark.multirank
def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    proc = train_process(tmp_path, "--max-steps", "1000", "--checkpoint-interval", "1",
                         "--keep-checkpoints", "3")
    deadline = time.monotonic() + 600
    try:
        while not list((tmp_path / "checkpoints").glob(".step-[3-9]*.tmp")):
            assert time.monotonic() < deadline and proc.poll() is None, "no save observed"
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    latest = complete_checkpoints(tmp_path)[-1]
    step = int(latest.name.split("-")[1])
    assert step >= 2 and (latest / "metadata.json").is_file()
    resumed = train_process(tmp_path, "--max-steps", str(step + 1), "--resume")
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    assert max(column(tmp_path)) == step + 1


@pytest.mark.multirank
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])  # USR1: Slurm's warning
def test_sigterm_saves_a_final_checkpoint(tmp_path: Path, signum: int) -> None:
    proc = train_process(tmp_path, "--max-steps", "1000", "--checkpoint-interval", "500")
    deadline = time.monotonic() + 600
    while not (tmp_path / "metrics-0.jsonl").is_file() or not (
            tmp_path / "metrics-0.jsonl").read_text().strip():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err  # what a requeue script looks for
    (latest,) = complete_checkpoints(tmp_path)
    assert int(latest.name.split("-")[1]) == max(column(tmp_path))


@pytest.mark.multirank
def test_rank_failure_ends_the_job_with_its_message(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "loom", "launch", "-n", "2", sys.executable,
            "tests/workers/failing_worker.py", *COMMON, "--max-steps", "50", "--outdir",
            str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_"))}
    proc = subprocess.run(argv, cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "rank 1 failed on purpose at step 3" in proc.stderr


@pytest.mark.multirank
def test_export_loads_in_transformers_with_the_same_logits(resume_runs: Path,
                                                           tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from loom.hf.export import export
    from loom.hf.run_checkpoint import load_model_state
    from loom.models.llama.model import Transformer

    checkpoint = resume_runs / "dp2-resumed" / "checkpoints" / "step-20"
    export(checkpoint, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    state, args = load_model_state(checkpoint)
    model = Transformer(args)
    model.load_state_dict(state)
    tokens = torch.randint(args.vocab_size, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), atol=1e-4, rtol=1e-4)
