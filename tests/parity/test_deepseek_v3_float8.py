"""DeepSeek-V3 under `--float8 tensorwise`: latent attention's projections, the dense
SwiGLU and the shared experts in float8 (the router gates, the stacked routed experts, the
MTP modules and the head in fp32: tests/unit/numerics/test_float8.py), against one process
that also runs float8, as the layout sweep compares float8 layouts
(tests/parity/test_layout_sweep.py, whose tolerances these are). Tensorwise scales come from
each forward's own batch, so the reference accumulates two two-sample forwards, as each dp
rank here holds two samples (tp ranks share theirs).

Routing is not replayed (the reference's forwards are half batches, which the recorded
picks do not index): each run routes by itself, as the sweep's MoE float8 layout does.
Measured at ep 2: step 1's loss equal, its gradient norm within 1.8e-7; steps 2-5 worst
4.6e-5 (loss), 1.2e-3 (gradient norm); final parameters 7.2e-3 of a norm.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.compare import assert_norms_close, assert_series_close, column
from tests.harness import run_ranks
from tests.parity.test_deepseek_v3_parity import COMMON, GLOBAL_BATCH
from tests.parity.test_layout_sweep import GRAD_NORM, parameters, tolerances

FLOAT8 = ["--float8", "tensorwise"]
REFERENCE = [*FLOAT8, "--batch-size", "2", "--grad-accum-steps", "2"]
SHARDED_PARAMS_RTOL = 2e-1
"""Final parameters under tp, per tensor of its norm, above the sweep's 1e-1: with routing
free and tp ranks scaling their own shards, a routed expert's tokens and so its five
sign-like AdamW updates (together ~2.5e-1 of the norm of a 16384-element expert weight at
lr 1e-3) differ. Measured worst 9.8e-2 (layers.2.moe.experts.w2; attention and dense
weights 4-5e-2); the plan's sharding is checked at step 1, where the loss is within 1.6e-5
and the gradient norm 4.1e-3 (float8 itself moves it by 2.1e-3 from fp32's)."""
LAYOUTS = {  # name: (world size, dp degree, flags)
    "float8_ep2": (2, 2, [*FLOAT8, "--ep", "2"]),
    "float8_dp2_tp2": (4, 2, [*FLOAT8, "--dp-shard", "2", "--tp", "2"]),
}


def train(world: int, runs: list[list[str]]) -> None:
    job = run_ranks(world, ["tests/workers/parity_worker.py", json.dumps(runs)], timeout=1200)
    assert job.ok, job.describe()


@pytest.fixture(scope="module")
def float8_reference(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("deepseek_float8") / "float8_single"
    train(1, [[*COMMON, *REFERENCE, "--outdir", str(folder)]])
    losses = column(folder)
    assert len(losses) == 5 and losses[5] < losses[1], "the reference should make progress"
    return folder


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_float8_layout_matches_float8_single_process(float8_reference: Path, tmp_path: Path,
                                                     layout: str) -> None:
    """Losses and gradient norms at step 1 (the same weights: the same casts, except where
    tp or cp ranks scale their own shards) and after it, final parameters norm-wise."""
    world, dp, flags = LAYOUTS[layout]
    run = tmp_path / layout
    train(world, [[*COMMON, *flags, "--batch-size", str(GLOBAL_BATCH // dp), "--outdir",
                   str(run)]])
    first, later = tolerances(flags)
    if "--tp" in flags:
        later = {**later, "params": SHARDED_PARAMS_RTOL}
    for key in ("train/loss", GRAD_NORM):
        new, ref = column(run, key), column(float8_reference, key)
        assert_series_close({1: new[1]}, {1: ref[1]}, rtol=first[key], what=f"{key} at step 1")
        assert_series_close(new, ref, rtol=later[key], what=key)
    assert_norms_close(parameters(run), parameters(float8_reference), rtol=later["params"],
                       what="parameters after 5 AdamW steps")
