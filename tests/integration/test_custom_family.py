"""A model family registered from tests/ (GPT-2 style: learned positions, LayerNorm, GELU)
trains under dp2, tp2 and pp2 with the losses of one process, checkpoints its own six
arguments, resumes a dp2 checkpoint at tp2 with the uninterrupted run's losses, is planned
by `loom plan` and passes `loom verify`, with nothing under src/ written for it: its spec
(and its plan, registered by the family's name) tells loom what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.compare import losses
from tests.harness import REPO, run_ranks

PYTHONPATH = os.environ.get("PYTHONPATH", "")

LOSS_RTOL = 1e-5
GLOBAL_BATCH = 4
ARGS = {"dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 256, "max_seq_len": 32768,
        "gpt2_activation": "gelu"}
"""The family's own arguments (max_seq_len, gpt2_activation: the flags' defaults), all a
checkpoint records."""
FAMILY = ["--model", "gpt2-test-tiny", "--dataset", "random", "--fp32", "--seed", "3",
          "--lr", "3e-3"]
"""The family's own preset (dim 64, 2 blocks, 4 heads, vocabulary 256, seq 32)."""
LAYOUTS = {"single": (1, []), "dp2": (2, ["--dp-shard", "2"]), "tp2": (2, ["--tp", "2"]),
           "pp2": (2, ["--pp", "2"]),
           "saved-dp2": (2, ["--dp-shard", "2", "--max-steps", "2", "--checkpoint-interval",
                             "2"]),
           "resumed-tp2": (2, ["--tp", "2", "--resume", "{root}/saved-dp2/checkpoints/step-2"])}
"""`saved-dp2` stops at step 2 with a checkpoint; `resumed-tp2` continues it at tp2 (in the
same job, after it)."""


def run_args(root: Path, name: str, flags: list[str], world: int) -> list[str]:
    dp = 2 if "dp2" in name else 1
    return [*FAMILY, "--max-steps", "4", *(f.format(root=root) for f in flags),
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


@pytest.mark.multirank
def test_test_family_checkpoints_its_own_arguments_and_resumes_at_another_layout(
        family_runs: Path) -> None:
    """The checkpoint records {family, **its six arguments} (no Llama field); resumed at
    tp2, steps 3-4 have the losses of the run that never stopped."""
    loop = json.loads((family_runs / "saved-dp2" / "checkpoints" / "step-2" / "loop.json")
                      .read_text())
    assert loop["model_args"] == ARGS
    assert loop["architecture"] == {"family": "gpt2-test", **ARGS}
    resumed = losses(family_runs / "resumed-tp2")
    assert len(resumed) == 2, resumed
    torch.testing.assert_close(resumed, losses(family_runs / "single")[2:], rtol=LOSS_RTOL,
                               atol=0)


def family_cli(*argv: str) -> list[str]:
    """`loom ARGV` in a process that registered the test family first."""
    return ["tests/workers/family_cli.py", *argv]


def test_test_family_is_planned_by_loom_plan(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, *family_cli(
        "plan", "--world-size", "2", "--device", "cpu", "--device-memory", "4GiB", *FAMILY,
        "--dp-shard", "2", "--batch-size", "2", "--json")], capture_output=True, text=True,
        timeout=600, cwd=REPO, env={**os.environ, "LOOM_CACHE_DIR": str(tmp_path / "cache"),
                                    "PYTHONPATH": f"{REPO}{os.pathsep}{PYTHONPATH}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    assert plan["fits"] and plan["layout"]["dp_shard"] == 2, plan
    assert 0 < plan["breakdown"]["parameters"] < plan["peak_gib"], plan


@pytest.mark.multirank
def test_test_family_passes_loom_verify(tmp_path: Path) -> None:
    job = run_ranks(2, family_cli("verify", "--layouts", "dp2", "tp2", "--steps", "2",
                                  "--json", "--outdir", str(tmp_path / "verify"), *FAMILY),
                    timeout=900, env={"LOOM_CACHE_DIR": str(tmp_path / "cache")})
    assert job.ok, job.describe()
    result = json.loads(job.ranks[0].stdout)
    assert result["reference"] == "dp2"
    (tp2,) = result["layouts"]
    assert tp2["layout"] == "tp2" and tp2["ok"] and tp2["first_differing"] is None, tp2
