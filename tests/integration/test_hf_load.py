"""Pretrained HF weights read by rank 0 only, streamed slice by slice or broadcast as a whole
model: on 2 ranks, tiny Llama (untied) and Qwen2 (tied embeddings) folders start from
exactly the weights and buffers every rank used to read itself, and the first steps' losses
are identical (fp32); the other rank never reads the checkpoint and streaming never loads
the whole model (the worker makes either fail)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.compare import column, worst
from tests.harness import run_ranks
from tests.hf_models import corpus_sample, save_tiny_model

ARCHS = ("llama", "qwen2")
LOADERS = ("stream", "whole-model", "every-rank")
STEPS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf_load")
    (root / "text.txt").write_text(corpus_sample())
    jobs = []
    for arch in ARCHS:
        save_tiny_model(root / arch, arch)
        jobs += [(loader, ["--model", str(root / arch), "--model-impl", "transformers",
                           "--dataset", str(root / "text.txt"),
                           "--seq-len", "32", "--batch-size", "2", "--fp32", "--dp-shard", "2",
                           "--max-steps", str(STEPS), "--seed", "5", "--lr", "3e-3",
                           "--outdir", str(root / "runs" / f"{arch}-{loader}")])
                 for loader in LOADERS]
    job = run_ranks(2, ["tests/workers/hf_load_worker.py", json.dumps(jobs)], timeout=600,
                    env={"LOOM_CACHE_DIR": str(root / "cache")})
    assert job.ok, job.describe()
    return root / "runs"


def assert_identical(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                     what: str) -> None:
    assert actual.keys() == expected.keys(), f"{what}: {sorted(actual)} vs {sorted(expected)}"
    for name, e in expected.items():
        diff, index = worst(actual[name], e)
        assert torch.equal(actual[name], e), f"{what}: {name}{list(index)} differs by {diff:.3g}"


@pytest.mark.multirank
@pytest.mark.parametrize("loader", LOADERS[:2])
@pytest.mark.parametrize("arch", ARCHS)
def test_rank0_load_matches_every_rank_reading(runs: Path, arch: str, loader: str) -> None:
    new, old = runs / f"{arch}-{loader}", runs / f"{arch}-every-rank"
    initial = torch.load(new / "initial.pt")
    assert any("inv_freq" in name for name in initial), sorted(initial)
    assert_identical(initial, torch.load(old / "initial.pt"), "initial weights and buffers")
    losses, reference = column(new), column(old)
    assert len(reference) == STEPS, reference
    worst_diff = max(abs(losses[s] - reference[s]) for s in reference)
    assert losses == reference, f"losses differ by up to {worst_diff:.3g}: {losses} vs {reference}"
