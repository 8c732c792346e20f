"""LoRA (`--lora-rank`) on a tiny Hugging Face Llama folder: 20 steps at dp 2 and at tp 2
give the single process's losses, only the adapters train and hold optimizer state (by
count), and the run's checkpoint exports as a merged model transformers checks and as a
PEFT adapter folder `peft` loads with loom's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.compare import column
from tests.harness import run_ranks
from tests.hf_models import save_tiny_model

STEPS = 20
RANK = 8
COMMON = ["--dataset", "random", "--seq-len", "32", "--fp32", "--max-steps", str(STEPS),
          "--seed", "7", "--lr", "1e-2", "--lora-rank", str(RANK), "--lora-alpha", "16"]
LOSS_RTOL = 1e-5
PARAM_NORM_RTOL = 1e-3
"""As tests/test_parity.py: per tensor, after AdamW steps (measured worst 1.2e-4 at tp2)."""
LAYOUTS = {"dp2": ["--dp-shard", "2", "--batch-size", "2"],
           "tp2": ["--tp", "2", "--batch-size", "4"]}


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory) -> Path:
    """The single process (with a checkpoint at the end), then dp2 and tp2 in one 2-rank
    job."""
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_model(root / "base", "llama")
    common = ["--model", str(base), *COMMON]
    single = [[*common, "--batch-size", "4", "--checkpoint-interval", str(STEPS),
               "--outdir", str(root / "single")]]
    job = run_ranks(1, ["tests/workers/lora_worker.py", json.dumps(single)], timeout=600)
    assert job.ok, job.describe()
    runs = [[*common, *flags, "--outdir", str(root / name)] for name, flags in LAYOUTS.items()]
    job = run_ranks(2, ["tests/workers/lora_worker.py", json.dumps(runs)], timeout=900)
    assert job.ok, job.describe()
    return root


def counts(run: Path) -> dict:
    return json.loads((run / "lora.json").read_text())


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_layout_matches_single_process(lora_runs: Path, layout: str) -> None:
    reference, got = column(lora_runs / "single"), column(lora_runs / layout)
    assert len(reference) == STEPS and reference[STEPS] < reference[1], "no progress"
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, rel=LOSS_RTOL), f"{layout} step {step}"
    ref_params = torch.load(lora_runs / "single" / "params.pt")
    params = torch.load(lora_runs / layout / "params.pt")
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        if "lora_" not in name:  # frozen: bit for bit the base folder's
            assert torch.equal(params[name], ref), name
            continue
        diff = (params[name] - ref).norm() / ref.norm()
        assert diff <= PARAM_NORM_RTOL, f"{layout} {name}: {diff:.2e}"
    assert counts(lora_runs / layout) == counts(lora_runs / "single")


@pytest.mark.multirank
def test_only_the_adapters_train_or_hold_optimizer_state(lora_runs: Path) -> None:
    """By count: 2 blocks x 7 linears x r (in + out) adapter elements train; AdamW holds
    two states of each; no other parameter is in the optimizer."""
    got = counts(lora_runs / "single")
    dim, hidden, kv = 32, 64, 2 * 8  # tests/hf_models.py SHAPE: 2 kv heads of width 8
    per_block = RANK * ((dim + dim) * 2 + (dim + kv) * 2 + (dim + hidden) * 3)
    assert sum(got["trainable"].values()) == 2 * per_block
    assert set(got["trainable"]) == {n for n in got["trainable"] if n.endswith(
        (".lora_A", ".lora_B"))} and len(got["trainable"]) == 2 * 7 * 2
    assert got["optimizer_params"] == sorted(got["trainable"])
    assert got["optimizer_state"] == 2 * 2 * per_block
    assert got["total"] > 5 * 2 * per_block  # the frozen base is most of the model
