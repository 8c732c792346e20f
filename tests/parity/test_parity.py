"""Parity: the same seed and global batch on 1 process and on N ranks under each mesh give
the same first-step gradients, per-step losses and final parameters (fp32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.compare import assert_norms_close, assert_series_close, assert_tensors_close, column
from tests.harness import run_ranks

GLOBAL_BATCH = 4
COMMON = ["--model", "debug", "--dataset", "random", "--vocab-size", "512", "--seq-len", "64",
          "--fp32", "--max-steps", "5", "--seed", "7", "--lr", "1e-3"]
LOSS_RTOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-7
"""First-step gradients differ only by fp32 summation order (sharded or tp-split reductions):
measured worst 0.13x this allowance (9e-8 absolute). A wrong scale or a missing reduction is
off by tens of percent."""
PARAM_NORM_RTOL = 1e-3
"""AdamW's first updates are ~lr * sign(grad), so a near-zero gradient whose sign depends on
the summation order moves one element by up to 2 * lr (seen: one of 49,152 elements of w2 off
by 2.7e-5 on an AVX2 EPYC): an element-wise bound after several steps is not sound. Per tensor,
||p - p_ref|| <= 1e-3 ||p_ref|| is: measured worst 1.6e-5 (tp2), while 5 steps move a weight
by up to ~25% of its norm (lr 1e-3 vs init std 0.02), so a 10% error in the updates is ~2e-2."""

LAYOUTS = {  # name: (world size, flags); batch per dp rank keeps the global batch at 4
    "dp_shard2": (2, ["--dp-shard", "2"]),
    "tp2": (2, ["--tp", "2"]),
    "reshard_never": (2, ["--dp-shard", "2", "--reshard-after-forward", "never"]),
    "dp_shard2_compile": (2, ["--dp-shard", "2", "--compile", "--compile-backend", "aot_eager"]),
    "dp_shard4": (4, ["--dp-shard", "4"]),
    "dp2_tp2": (4, ["--tp", "2"]),
    "hsdp2x2": (4, ["--dp-replicate", "2", "--dp-shard", "2"]),
}


def dp_degree(world: int, flags: list[str]) -> int:
    """Ranks with different samples: tp and cp ranks share theirs."""
    tp, cp = (int(flags[flags.index(f) + 1]) if f in flags else 1 for f in ("--tp", "--cp"))
    return world // (tp * cp)


def run_layouts(world: int, names: list[str], root: Path,
                layouts: dict[str, tuple[int, list[str]]] = LAYOUTS) -> None:
    runs = []
    for name in names:
        size, flags = layouts.get(name, (1, []))
        batch = GLOBAL_BATCH // dp_degree(size, flags)
        runs.append([*COMMON, *flags, "--batch-size", str(batch), "--outdir", str(root / name)])
    job = run_ranks(world, ["tests/workers/parity_worker.py", json.dumps(runs), "--first-grads"],
                    timeout=1200)
    assert job.ok, job.describe()


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
    assert_matches_single(parity_runs, layout)


def assert_matches_single(root: Path, layout: str) -> None:
    """First-step gradients, losses and final parameters of `root/layout` against
    `root/single`."""
    single, run = root / "single", root / layout
    reference = column(single)
    assert len(reference) == 5 and reference[5] < reference[1], "training should make progress"
    grads = torch.load(single / "first-grads.pt")
    assert all(g.abs().sum() > 0 for g in grads.values()), "a parameter has no gradient"
    assert_tensors_close(torch.load(run / "first-grads.pt"), grads, rtol=GRAD_RTOL,
                         atol=GRAD_ATOL, what="first-step gradient")
    assert_series_close(column(run), reference, rtol=LOSS_RTOL)
    assert_norms_close(torch.load(run / "params.pt"), torch.load(single / "params.pt"),
                       rtol=PARAM_NORM_RTOL, what="parameters after 5 AdamW steps")


SINGLE_FSDP2 = {"single_fsdp2": (1, ["--single-device", "fsdp2"])}
"""One process under FSDP2 (`--single-device fsdp2`), against the default unwrapped model."""
SINGLE_RTOL = 1e-5


@pytest.mark.multirank
def test_the_unwrapped_single_device_model_matches_fsdp2_at_one_process(tmp_path) -> None:
    """At world size 1 the model is left unwrapped (`loom.parallel.single`); FSDP2 over a
    size-1 mesh computes the same (fp32): gradients, per-step losses and the parameters
    after 5 steps agree within 1e-5, the two differing only in where the gradients live."""
    run_layouts(1, ["single", "single_fsdp2"], tmp_path, {**LAYOUTS, **SINGLE_FSDP2})
    single, wrapped = tmp_path / "single", tmp_path / "single_fsdp2"
    config = json.loads((single / "config.json").read_text())
    assert config["parallel"]["single_device"] == "plain"
    assert_tensors_close(torch.load(wrapped / "first-grads.pt"),
                         torch.load(single / "first-grads.pt"), rtol=SINGLE_RTOL,
                         atol=GRAD_ATOL, what="first-step gradient")
    assert_series_close(column(wrapped), column(single), rtol=SINGLE_RTOL)
    assert_tensors_close(torch.load(wrapped / "params.pt"), torch.load(single / "params.pt"),
                         rtol=SINGLE_RTOL, atol=1e-7, what="parameters after 5 AdamW steps")
