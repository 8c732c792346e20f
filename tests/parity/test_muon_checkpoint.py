"""Muon's state travels: a dp 2 run's checkpoint (each matrix's momentum buffer and step,
AdamW's state for the rest) loads at tp 2 and at one process with every state tensor equal
to the saved one, and the next 5 steps equal the uninterrupted dp 2 run's (1e-6). Newton-
Schulz runs in fp32 (--muon-ns-dtype fp32), so the layouts differ by fp32 order only.
A checkpoint of one --optimizer does not resume under the other (one line, no traceback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loom.checkpoint.checkpointer import Checkpointer
from loom.checkpoint.trust import UnusableCheckpoint
from loom.config import OptimConfig
from loom.models.llama.model import ModelArgs
from loom.trainer.optim import build_optimizer
from tests.compare import column
from tests.harness import run_ranks
from tests.one_rank import one_rank_group
from tests.tiny import tiny_model

COMMON = ["--model", "debug", "--dataset", "random", "--vocab-size", "512", "--seq-len", "64",
          "--fp32", "--seed", "11", "--lr", "1e-3", "--warmup-steps", "8",
          "--optimizer", "muon", "--muon-ns-dtype", "fp32"]
"""Warmup spans the resume point, so the scheduler's state must come back too."""
DP2 = [*COMMON, "--dp-shard", "2", "--batch-size", "2"]
TP2 = [*COMMON, "--tp", "2", "--dp-shard", "1", "--batch-size", "4"]
ONE = [*COMMON, "--batch-size", "4"]


def job(world: int, runs: list[list[str]]) -> None:
    result = run_ranks(world, ["tests/workers/checkpoint_worker.py", json.dumps(runs)],
                       timeout=900)
    assert result.ok, result.describe()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("muon-resume")
    job(2, [[*DP2, "--max-steps", "10", "--outdir", str(root / "straight")],
            [*DP2, "--max-steps", "5", "--checkpoint-interval", "5",
             "--outdir", str(root / "saved")]])
    step5 = str(root / "saved" / "checkpoints" / "step-5")
    for world, flags, name in ((2, TP2, "tp2"), (1, ONE, "one")):
        job(world, [[*flags, "--max-steps", "5", "--resume", step5,
                     "--outdir", str(root / f"{name}-loaded")],
                    [*flags, "--max-steps", "10", "--resume", step5,
                     "--outdir", str(root / name)]])
    return root


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["tp2", "one"])
def test_muon_state_resumes_at_another_layout(runs: Path, layout: str) -> None:
    saved = torch.load(runs / "saved" / "optim.pt")
    loaded = torch.load(runs / f"{layout}-loaded" / "optim.pt")
    buffers = [n for n, s in saved["state"].items() if "momentum_buffer" in s]
    assert "layers.0.attention.wq.weight" in buffers and "output.weight" not in buffers
    assert saved["state"].keys() == loaded["state"].keys()
    torch.testing.assert_close(loaded["state"], saved["state"], rtol=0, atol=0)
    straight, resumed = column(runs / "straight"), column(runs / layout)
    assert sorted(resumed) == list(range(6, 11))
    for step in range(6, 11):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-6, abs=0), step


@pytest.mark.multirank
def test_a_muon_checkpoint_does_not_resume_under_adamw(runs: Path) -> None:
    step5 = runs / "saved" / "checkpoints" / "step-5"
    saved = json.loads((step5 / "loop.json").read_text())
    model = tiny_model(ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=64, multiple_of=16))
    adamw = build_optimizer(model, OptimConfig())
    with one_rank_group(), pytest.raises(UnusableCheckpoint, match="resume with the "):
        Checkpointer.load(step5, model, adamw, 0, saved)
