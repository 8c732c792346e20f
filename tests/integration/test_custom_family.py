"""A model family registered from tests/ (GPT-2 style: learned positions, LayerNorm, GELU)
trains under dp2, tp2 and pp2 with the losses of one process, with nothing under src/
written for it: its spec alone tells the recipe, the pipeline cut and the init what to do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.compare import losses
from tests.harness import run_ranks

LOSS_RTOL = 1e-5
GLOBAL_BATCH = 4
LAYOUTS = {"single": (1, []), "dp2": (2, ["--dp-shard", "2"]), "tp2": (2, ["--tp", "2"]),
           "pp2": (2, ["--pp", "2"])}


def run_args(root: Path, name: str, flags: list[str], world: int) -> list[str]:
    dp = 2 if name == "dp2" else 1
    return ["--family", "gpt2-test", "--dim", "64", "--n-layers", "2", "--n-heads", "4",
            "--n-kv-heads", "4", "--dataset", "random", "--vocab-size", "256", "--seq-len",
            "32", "--fp32", "--max-steps", "4", "--seed", "3", "--lr", "3e-3", *flags,
            "--batch-size", str(GLOBAL_BATCH // dp), "--outdir", str(root / name)]


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("family")
    for world in (1, 2):
        runs = [run_args(root, name, flags, size) for name, (size, flags) in LAYOUTS.items()
                if size == world]
        job = run_ranks(world, ["tests/workers/family_worker.py", json.dumps(runs)],
                        timeout=900, env={"LOOM_CACHE_DIR": str(root / "cache")})
        assert job.ok, job.describe()
    return root


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_test_family_trains_like_one_process(family_runs: Path, layout: str) -> None:
    reference = losses(family_runs / "single")
    assert len(reference) == 4 and reference[-1] < reference[0], reference
    torch.testing.assert_close(losses(family_runs / layout), reference, rtol=LOSS_RTOL, atol=0)
    config = json.loads((family_runs / layout / "config.json").read_text())
    assert config["model"]["family"] == "gpt2-test"
