"""Losses a model adds in its own forward (the MoE sequence-wise balance loss, DeepSeek-V3's
multi-token prediction) weigh each forward of a step by its share of the step, like the
main loss: N micro-batches of B/N sequences train as one batch of B, under gradient
accumulation, under a pipeline's micro-batches and under both; their metrics are the
step's, in rank 0's row also where a later pipeline stage holds the modules.

Both losses are means over a micro-batch's sequences (the balance loss per sequence, MTP
per token of equally long sequences), so with equal micro-batches the mean of the N
micro-batch means is the whole batch's: the reference is one process, one forward of the
whole batch. Measured with each forward's losses weighted 1 (the bug this guards) at
--aux-loss-coeff 0.1: 2 accumulation steps, step 1's gradient norm 1.5914 vs 1.4223
(MTP alone 1.1e-1 relative, the balance loss alone on moe-debug 1.1e-2); at pp 2 with 2
accumulation steps, 1.6017 vs 1.4223, and no mtp/loss in rank 0's row. Fixed, within
2e-7 of the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.compare import assert_norms_close, assert_series_close, column
from tests.harness import run_ranks
from tests.parity.test_moe_parity import (
    PARAM_NORM_RTOL,
    RTOL,
    assert_losses_and_grad_norms_close,
)

COMMON = ["--dataset", "random", "--vocab-size", "512", "--seq-len", "64", "--fp32",
          "--max-steps", "2", "--seed", "7", "--lr", "1e-3", "--warmup-steps", "0"]
AUX_COEFF = ["--aux-loss-coeff", "0.1"]
"""A coefficient large enough that a doubled balance-loss gradient moves the norm by
percent."""
MTP = ["--model", "deepseek-v3-mtp-debug"]
WHOLE = ["--batch-size", "4"]
ACCUM = ["--batch-size", "2", "--grad-accum-steps", "2"]


def train(world: int, runs: dict[str, list[str]], root: Path) -> None:
    argvs = [[*COMMON, *flags, "--outdir", str(root / name)] for name, flags in runs.items()]
    job = run_ranks(world, ["tests/workers/parity_worker.py", json.dumps(argvs)],
                    timeout=600)
    assert job.ok, job.describe()


def assert_same_training(candidate: Path, reference: Path, *metrics: str) -> None:
    """Losses, gradient norms, the added losses' own metrics (in rank 0's row) and the
    final parameters."""
    assert_losses_and_grad_norms_close(candidate, reference)
    for metric in metrics:
        assert_series_close(column(candidate, metric), column(reference, metric), rtol=RTOL,
                            what=metric)
    assert_norms_close(torch.load(candidate / "params.pt"), torch.load(reference / "params.pt"),
                       rtol=PARAM_NORM_RTOL, what="parameters after 2 AdamW steps")


@pytest.mark.multirank
def test_accumulation_weighs_mtp_and_balance_losses_like_one_batch(tmp_path: Path) -> None:
    """DeepSeek-V3 (MoE layers of the MoE family's module) with MTP and the balance loss:
    2 accumulation steps of 2 sequences against one batch of 4, one process each."""
    flags = [*MTP, *AUX_COEFF]
    train(1, {"whole": [*flags, *WHOLE], "accum": [*flags, *ACCUM]}, tmp_path)
    assert_same_training(tmp_path / "accum", tmp_path / "whole", "mtp/loss", "moe/aux_loss")


@pytest.mark.multirank
@pytest.mark.slow
def test_pipeline_micro_batches_and_accumulation_weigh_like_one_batch(tmp_path: Path) -> None:
    """DeepSeek-V3 with MTP and the balance loss at pp 2: 2 accumulation steps of 2
    micro-batches each, 4 forwards of one sequence. The MTP modules sit on the last stage,
    rank 0 holds the first: its row reports the step's MTP loss all the same, and the
    balance loss of every stage's MoE layers."""
    flags = [*MTP, *AUX_COEFF]
    train(1, {"single": [*flags, *WHOLE]}, tmp_path)
    train(2, {"pp2_accum": [*flags, *ACCUM, "--pp", "2", "--pp-microbatches", "2"]}, tmp_path)
    assert_same_training(tmp_path / "pp2_accum", tmp_path / "single", "mtp/loss",
                         "moe/aux_loss")
