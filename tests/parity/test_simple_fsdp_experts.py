"""SimpleFSDP with fewer (local) experts than shard ranks (2 experts, top-1, on 4 ranks):
the stacked expert weights are sharded off dim 0, as FSDP2 shards them, so every rank holds
an equal share and none holds padding or nothing; training matches one process (fp32), also
under HSDP with expert parallel (`--dp-replicate 2 --ep 2`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.harness import run_ranks
from tests.parity.test_moe_parity import COMMON, FEW_EXPERTS, assert_same_run

SIMPLE = ["--data-parallel", "simple-fsdp"]
LAYOUTS = {  # name: flags on 4 ranks (dp 4, global batch 4)
    "few_dp4": [],
    "few_ep2": ["--ep", "2"],
    "few_hsdp2_ep2": ["--dp-replicate", "2", "--ep", "2"],
}
SHARDED = ("few_dp4", "few_ep2")
"""Layouts where every rank holds a different quarter of each expert weight."""
EXPERT_WEIGHTS = ("moe.experts.w1", "moe.experts.w2", "moe.experts.w3")


def job(world: int, runs: list[dict]) -> None:
    result = run_ranks(world, ["tests/workers/parity_worker.py", json.dumps(runs), "--shares"],
                       timeout=1200)
    assert result.ok, result.describe()


def train_layouts(root: Path) -> Path:
    """The single-process reference and every layout of LAYOUTS, trained into `root`."""
    job(1, [{"argv": [*COMMON, *FEW_EXPERTS, "--batch-size", "4", "--outdir",
                      str(root / "single")], "routing": "record"}])
    job(4, [{"argv": [*COMMON, *FEW_EXPERTS, *SIMPLE, *flags, "--batch-size", "1",
                      "--outdir", str(root / name)], "routing": str(root / "single")}
            for name, flags in LAYOUTS.items()])  # routing replayed: see tests/routing.py
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return train_layouts(tmp_path_factory.mktemp("simple_fsdp_experts"))


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_few_experts_match_one_process(runs: Path, layout: str) -> None:
    assert_same_run(runs / layout, runs / "single")


@pytest.mark.multirank
@pytest.mark.parametrize("layout", SHARDED)
def test_every_rank_holds_an_equal_share_of_each_expert_weight(runs: Path, layout: str) -> None:
    shares = json.loads((runs / layout / "shares.json").read_text())
    params = torch.load(runs / layout / "params.pt")
    experts = {n: s for n, s in shares.items() if n.endswith(EXPERT_WEIGHTS)}
    assert experts, sorted(shares)
    for name, per_rank in experts.items():
        assert per_rank == [params[name].numel() // 4] * 4, (name, per_rank)
