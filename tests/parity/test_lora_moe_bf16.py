"""LoRA on a mixture-of-experts model in bf16: `--lora-rank 4` on moe-debug (attention and
router targets) trains at one process, unwrapped under autocast, and at --ep 2 on 2 gloo
ranks (FSDP2's bf16 mixed precision, experts dispatched by all-to-all), and the two match.

Before the fix in `loom.models.moe.model.expert_matmul`, the single process failed at its
first backward: the experts' custom matmul op met autocast inside its forward but not in
its backward (a bf16 gradient against the saved fp32 weight)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.compare import assert_series_close, column
from tests.harness import run_ranks

STEPS = 5
GRAD_NORM = "grad/norm_preclip"
COMMON = ["--model", "moe-debug", "--dataset", "random", "--vocab-size", "512",
          "--seq-len", "64", "--dtype", "bf16", "--max-steps", str(STEPS), "--seed", "7",
          "--lr", "1e-3", "--warmup-steps", "0", "--lora-rank", "4",
          "--lora-targets", "attention.wq,wk,wv,wo,moe.router.gate"]
LOSS_RTOL = 2e-3
GRAD_NORM_RTOL = 4e-2
"""The two layouts round differently: one process keeps fp32 weights and autocast rounds
each matmul's operands to bf16 (elementwise ops stay fp32); FSDP2 rounds the gathered
weights to bf16 and computes every op in bf16; the experts' rows reach them by all-to-all.
bf16 keeps 8 significant bits, so each rounding moves a value by up to 2e-3 of itself, and
the bf16 router's near ties may route a token differently. Measured on an Intel Xeon (AMX),
5 steps: --ep 2 against one process, losses within 7.2e-4 and pre-clip gradient norms
within 1.2e-2 (step 1, at the same weights: 1.9e-5 and 1.9e-3); one process in bf16 against
fp32 differs as much (losses 5.6e-4, norms 1.4e-2). The allowances are ~3x those. A bug of
consequence is far above them: the adapters scaled by 1.25 (--lora-alpha 20 at --ep 2) move
step 1's gradient norm by 2.5e-1 and the losses by up to 3.8e-3. Final adapter weights are
not compared: AdamW's first updates are ~lr x sign(gradient), and bf16 flips the sign of
many near-zero gradients (fp32 against bf16 at one process: 0.22 of their norm)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lora_moe_bf16")
    single = [[*COMMON, "--batch-size", "4", "--outdir", str(root / "single")]]
    job = run_ranks(1, ["tests/workers/lora_worker.py", json.dumps(single)], timeout=600)
    assert job.ok, job.describe()
    ep2 = [[*COMMON, "--batch-size", "2", "--ep", "2", "--outdir", str(root / "ep2")]]
    job = run_ranks(2, ["tests/workers/lora_worker.py", json.dumps(ep2)], timeout=600)
    assert job.ok, job.describe()
    return root


@pytest.mark.multirank
def test_lora_on_moe_trains_in_bf16_at_one_process_and_at_ep2(runs: Path) -> None:
    single, ep2 = column(runs / "single"), column(runs / "ep2")
    assert len(single) == STEPS and single[STEPS] < single[1], "no progress"
    assert_series_close(ep2, single, rtol=LOSS_RTOL, what="ep2 loss")
    assert_series_close(column(runs / "ep2", GRAD_NORM), column(runs / "single", GRAD_NORM),
                        rtol=GRAD_NORM_RTOL, what="ep2 pre-clip gradient norm")
    ref, got = torch.load(runs / "single" / "params.pt"), torch.load(runs / "ep2" / "params.pt")
    assert ref.keys() == got.keys()
    for name in (n for n in ref if "lora_" not in n):  # frozen: the seeded init in both
        assert torch.equal(got[name], ref[name]), name
    trained = [n for n in ref if n.endswith(".lora_B")]  # B starts at zero
    assert any("router" in n for n in trained) and any("attention" in n for n in trained)
    for params in (ref, got):
        assert all(params[n].abs().max() > 0 for n in trained), "an adapter did not train"
    counts = [json.loads((runs / r / "lora.json").read_text()) for r in ("single", "ep2")]
    assert counts[0] == counts[1]
