"""Parity: the same seed and global batch on 1 process and on N ranks under each mesh give
the same per-step losses and final parameters (fp32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.harness import run_ranks

GLOBAL_BATCH = 4
COMMON = ["--model", "debug", "--dataset", "random", "--vocab-size", "512", "--seq-len", "64",
          "--fp32", "--max-steps", "5", "--seed", "7", "--lr", "1e-3"]
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5

LAYOUTS = {  # name: (world size, flags); batch per dp rank keeps the global batch at 4
    "dp_shard2": (2, ["--dp-shard", "2"]),
    "tp2": (2, ["--tp", "2"]),
    "reshard_never": (2, ["--dp-shard", "2", "--reshard-after-forward", "never"]),
    "dp_shard4": (4, ["--dp-shard", "4"]),
    "dp2_tp2": (4, ["--tp", "2"]),
    "hsdp2x2": (4, ["--dp-replicate", "2", "--dp-shard", "2"]),
}


def dp_degree(world: int, flags: list[str]) -> int:
    tp = int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 1
    return world // tp


def run_layouts(world: int, names: list[str], root: Path) -> None:
    runs = []
    for name in names:
        size, flags = LAYOUTS.get(name, (1, []))
        batch = GLOBAL_BATCH // dp_degree(size, flags)
        runs.append([*COMMON, *flags, "--batch-size", str(batch), "--outdir", str(root / name)])
    job = run_ranks(world, ["tests/parity_worker.py", json.dumps(runs)], timeout=300)
    assert job.ok, job.describe()


def losses(folder: Path) -> list[float]:
    rows = [json.loads(line) for line in (folder / "metrics-0.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows]


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("parity")
    run_layouts(1, ["single"], root)
    run_layouts(2, [n for n, (w, _) in LAYOUTS.items() if w == 2], root)
    run_layouts(4, [n for n, (w, _) in LAYOUTS.items() if w == 4], root)
    return root


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(parity_runs: Path, layout: str) -> None:
    reference, candidate = losses(parity_runs / "single"), losses(parity_runs / layout)
    assert len(candidate) == len(reference) == 5
    assert reference[-1] < reference[0], "training should make progress"
    torch.testing.assert_close(torch.tensor(candidate), torch.tensor(reference),
                               rtol=LOSS_RTOL, atol=0)
    ref_params = torch.load(parity_runs / "single" / "params.pt")
    params = torch.load(parity_runs / layout / "params.pt")
    assert params.keys() == ref_params.keys()
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=0, atol=PARAM_ATOL, msg=name)
