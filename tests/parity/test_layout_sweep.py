"""Every accepted pair of parallelism features composes: each layout of the sweep turns on
several features at once (`loom.config.compose.FEATURES`) and trains 5 steps on 4 gloo ranks,
all layouts in turn in one job (tests/workers/parity_worker.py), against one process with
the same model, seed and global batch (fp32): per-step losses and pre-clip gradient norms
within `RTOL`, final parameters per tensor within `PARAM_NORM_RTOL` of their norm. A layout
that fails is named with the check it failed; every failing layout is reported at once.

float8 is lossy, so float8 layouts are compared with one process that also runs --float8.
Tensorwise scaling takes each activation's scale from the forward's own batch, so that
process accumulates 4 one-sample forwards (as each dp rank and pipeline micro-batch holds one
sample); with the whole batch in one forward step 1's loss differs by 1.4e-4 (a rank's scale
is not the batch's). See `FLOAT8_RTOL` for the steps after the first.
MoE layouts replay their single process's routing (tests/routing.py), as the MoE parity
tests do; under pipeline parallel the routers see micro-batches, which the recorded picks
do not index, so pp MoE layouts route by themselves (as test_moe_pp2_ep2_matches_single_
process does).

The default selection trains `FAST` (three eager layouts, one 4-rank job) and `COMPILED_AC`
(compile with activation checkpointing under tp and SimpleFSDP, aot_eager); `SWEEP` runs
under slow. `loom.config.compose.TESTED` names the case each pair is covered by.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.compare import assert_norms_close, assert_series_close, column
from tests.harness import run_ranks
from tests.routing import load_flips

GLOBAL_BATCH = 4
DENSE = ["--model", "debug", "--dataset", "random", "--vocab-size", "512", "--seq-len", "64",
         "--fp32", "--max-steps", "5", "--seed", "7", "--lr", "1e-3"]
MOE = ["--model", "moe-debug", "--dataset", "random", "--vocab-size", "512", "--seq-len", "64",
       "--fp32", "--max-steps", "5", "--seed", "7", "--lr", "1e-3", "--warmup-steps", "0"]
RTOL = 1e-5
"""Losses and pre-clip gradient norms, every step, relative."""
PARAM_NORM_RTOL = 1e-3
"""Per tensor, as in test_parity.py: AdamW can turn a reduction-order difference on a ~0
gradient into a 2 * lr step on one element, so final parameters are compared norm-wise."""
GRAD_NORM = "grad/norm_preclip"
FLOAT8_RTOL = {"train/loss": 1e-4, "grad/norm_preclip": 5e-2, "params": 2e-2}
"""float8 after step 1 (step 1, at the same weights, keeps `RTOL`: measured worst 6e-8 loss,
2e-7 gradient norm): weights that differ by rounding after an update round to other float8
values here and there, and the runs part step by step. Measured worst at step 5: 2.9e-5
(loss, dp_replicate 2 x pp 2), 2.5e-2 (gradient norm, MoE ep 2, whose routing is free here),
9.8e-3 (a parameter's norm); float8 against fp32 differ by 1.4e-4 in step 1's loss. These
bounds catch a run that stops training alike; a wrong scale or reduction shows at step 1."""
SHARDED_FLOAT8_RTOL = {"train/loss": 5e-4, "grad/norm_preclip": 5e-2, "params": 1e-1}
SHARDED_FLOAT8_STEP1_RTOL = {"train/loss": 5e-4, "grad/norm_preclip": 1e-2}
"""float8 with --tp or --cp: no one process takes the same tensorwise scales, so step 1
differs too. cp ranks scale their half sequences' activations; under tp, FSDP2's float8
all-gather takes each weight's scale over the dp shards of one tp shard (torchao 0.18's
`WeightWithDynamicFloat8CastTensor`), and over gloo torch's TP styles leave some gradient
casts to each tp rank's shard (`loom.parallel.tp_styles`). Measured at step 1 against two
two-sample forwards: loss 2.3e-4 (tp 2; 1e-6 with FSDP's float8 all-gather off), 6.8e-5
(cp 2), gradient norm 7.8e-4 (tp 2), 1.3e-3 (cp 2); at steps 2-5 worst 2.3e-4 (loss, tp 2),
6.6e-3 (gradient norm, cp 2); final parameters 7.2e-2 of a norm (a block's feed_forward.w2,
tp 2: AdamW's normalised steps turn scale differences on its small gradients into whole
lr-sized steps of other signs; worst element off by 7.5e-3 at lr 1e-3). float8 and fp32
differ by 1.4e-4 in step 1's loss, so these bounds catch a plan that shards wrongly (a
missing reduction is off by O(1)), not a scale that is a little off."""
TIE_MARGIN = 1e-4
"""As tests/parity/test_moe_parity.py: a replayed token's own choice may differ only on a
near tie."""

FLOAT8 = ["--float8", "tensorwise"]
COMPILE = ["--compile", "--compile-backend", "aot_eager"]
AC = ["--ac", "block"]
FUSED = ["--loss-impl", "fused-linear"]
LOSS_PARALLEL = ["--loss-impl", "loss-parallel"]
SIMPLE = ["--data-parallel", "simple-fsdp"]
INTERLEAVED = ["--pp", "2", "--pp-schedule", "interleaved-1f1b"]
ONE_F_ONE_B = ["--pp", "2", "--pp-schedule", "1f1b"]

ONE_SAMPLE_FORWARDS = ["--batch-size", "1", "--grad-accum-steps", str(GLOBAL_BATCH)]
TWO_SAMPLE_FORWARDS = ["--batch-size", "2", "--grad-accum-steps", "2"]
"""For float8 layouts of dp degree 2: each dp rank's forward holds two samples (tp and cp
ranks share them: tp's float8 casts scale the whole DTensor activation)."""
REFERENCES = {  # name: (model flags, flags); one process, the global batch
    "single": (DENSE, ["--batch-size", str(GLOBAL_BATCH)]),
    "single_float8": (DENSE, [*FLOAT8, *ONE_SAMPLE_FORWARDS]),
    "single_float8_dp2": (DENSE, [*FLOAT8, *TWO_SAMPLE_FORWARDS]),
    "moe_single": (MOE, ["--batch-size", str(GLOBAL_BATCH)]),
    "moe_single_float8": (MOE, [*FLOAT8, *ONE_SAMPLE_FORWARDS]),
}
RECORDS_ROUTING = ("moe_single",)
"""The references whose routing layouts replay. The float8 one's forwards hold one sample
each, which the layouts' recorded picks do not index: its layouts route by themselves."""
FAST = {  # name: (reference, dp degree, flags) on 4 ranks
    "dpr2_tp2_loss_parallel_ac": ("single", 2, ["--dp-replicate", "2", "--dp-shard", "1",
                                                "--tp", "2", *LOSS_PARALLEL, *AC]),
    "simple_fsdp_dp2_tp2_loss_parallel": ("single", 2, [*SIMPLE, "--dp-shard", "2", "--tp",
                                                        "2", *LOSS_PARALLEL]),
    "pp2_cp2_1f1b": ("single", 1, [*ONE_F_ONE_B, "--cp", "2", "--dp-shard", "1"]),
}
COMPILED_AC = {
    "dp2_tp2_loss_parallel_block_ac_compile": ("single", 2, [
        "--dp-shard", "2", "--tp", "2", *LOSS_PARALLEL, *AC, *COMPILE]),
    "simple_fsdp_hsdp2x2_ac_compile": ("single", 4, [
        *SIMPLE, "--dp-replicate", "2", "--dp-shard", "2", *AC, *COMPILE]),
    "dp2_tp2_op_ac_compile": ("single", 2, ["--dp-shard", "2", "--tp", "2", "--ac", "op",
                                            *COMPILE]),
    "simple_fsdp_dp2_tp2_ac_compile": ("single", 2, [*SIMPLE, "--dp-shard", "2", "--tp", "2",
                                                     *AC, *COMPILE]),
}
"""Compile with activation checkpointing under tp and SimpleFSDP: checkpointed inside each
compiled block where the torch runs that, each compiled block checkpointed whole where it
does not (`loom.parallel.parallelize.checkpoint_outside_compile`), exact either way.
SimpleFSDP runs over HSDP 2 x 2 and with tp 2: torch 2.11's Dynamo fails a view of the
stored _StridedShard weight (`PendingUnbackedSymbolNotFound`), so SimpleFSDP's gather takes
its gradient scale on the dp-only view (`loom.parallel.simple_fsdp.Gather.replicate`)."""
SWEEP = {
    "pp2_dp2_simple_fsdp_1f1b": ("single", 2, [*ONE_F_ONE_B, *SIMPLE, "--dp-shard", "2"]),
    "pp2_cp2_simple_fsdp_interleaved": ("single", 1, [*INTERLEAVED, "--cp", "2", *SIMPLE,
                                                      "--dp-shard", "1"]),
    "pp2_tp2_interleaved_loss_parallel_compile": ("single", 1, [*INTERLEAVED, "--tp", "2",
                                                                *LOSS_PARALLEL, *COMPILE]),
    # SimpleFSDP + AC + compile runs in COMPILED_AC; this layout keeps HSDP eager.
    "simple_fsdp_hsdp2x2_fused_linear_ac": ("single", 4, [
        *SIMPLE, "--dp-replicate", "2", "--dp-shard", "2", *FUSED, *AC]),
    "dp4_fused_linear_compile": ("single", 4, ["--dp-shard", "4", *FUSED, *COMPILE]),
    "dpr2_pp2_1f1b_float8_ac_compile": ("single_float8", 2, [
        "--dp-replicate", "2", "--dp-shard", "1", *ONE_F_ONE_B, *FLOAT8, *AC, *COMPILE]),
    "dpr2_pp2_interleaved_float8_fused_linear": ("single_float8", 2, [
        "--dp-replicate", "2", "--dp-shard", "1", *INTERLEAVED, *FLOAT8, *FUSED]),
    "moe_pp2_interleaved_ep2": ("moe_single", 2, [*INTERLEAVED, "--dp-shard", "2", "--ep",
                                                  "2"]),
    "moe_dp2_tp2_ep2_loss_parallel": ("moe_single", 2, ["--dp-shard", "2", "--tp", "2",
                                                        "--ep", "2", *LOSS_PARALLEL]),
    "dp2_tp2_float8": ("single_float8_dp2", 2, ["--dp-shard", "2", "--tp", "2", *FLOAT8]),
    "dpr2_tp2_float8_loss_parallel": ("single_float8_dp2", 2, [
        "--dp-replicate", "2", "--dp-shard", "1", "--tp", "2", *FLOAT8, *LOSS_PARALLEL]),
    "simple_fsdp_dp4_float8": ("single_float8", 4, [*SIMPLE, "--dp-shard", "4", *FLOAT8]),
    "cp2_dp2_float8": ("single_float8_dp2", 2, ["--cp", "2", "--dp-shard", "2", *FLOAT8]),
    "moe_ep2_float8_fused_linear": ("moe_single_float8", 4, ["--dp-shard", "4", "--ep", "2",
                                                             *FLOAT8, *FUSED]),
}


def references(root: Path, layouts: dict) -> list[dict]:
    """The one-process runs `layouts` compare with; MoE ones record their routing."""
    names = sorted({reference for reference, _, _ in layouts.values()})
    return [{"argv": [*REFERENCES[n][0], *REFERENCES[n][1], "--outdir", str(root / n)],
             "routing": "record" if n in RECORDS_ROUTING else None} for n in names]


def layout_runs(root: Path, layouts: dict) -> list[dict]:
    """Each layout's run; MoE layouts outside a pipeline replay their reference's routing."""
    runs = []
    for name, (reference, dp, flags) in layouts.items():
        model, _ = REFERENCES[reference]
        replay = reference in RECORDS_ROUTING and "--pp" not in flags
        runs.append({"argv": [*model, *flags, "--batch-size", str(GLOBAL_BATCH // dp),
                              "--outdir", str(root / name)],
                     "routing": str(root / reference) if replay else None})
    return runs


def train(root: Path, layouts: dict) -> Path:
    """The references in one process, then every layout in turn in one 4-rank job."""
    for world, runs in ((1, references(root, layouts)), (4, layout_runs(root, layouts))):
        job = run_ranks(world, ["tests/workers/parity_worker.py", json.dumps(runs)],
                        timeout=2400)
        assert job.ok, f"stopped in {unfinished(runs)[:1]}\n{job.describe()}"
    return root


def unfinished(runs: list[dict]) -> list[str]:
    """The runs (by folder name) that did not log 5 steps: the first is the one that failed."""
    folders = [Path(run["argv"][run["argv"].index("--outdir") + 1]) for run in runs]
    return [f.name for f in folders if not (f / "metrics-0.jsonl").exists() or
            len(column(f)) < 5]


def parameters(folder: Path) -> dict[str, torch.Tensor]:
    """A run's saved parameters as plain tensors: an unsharded float8 run saves torchao's
    weight wrapper (this test's own file, so loading it whole is safe)."""
    saved = torch.load(folder / "params.pt", weights_only=False)
    return {name: getattr(t, "_tensor", t) for name, t in saved.items()}


def tolerances(flags: list[str]) -> tuple[dict, dict]:
    """(step 1's, every step's and the final parameters') relative bounds for a layout."""
    exact = {"train/loss": RTOL, GRAD_NORM: RTOL, "params": PARAM_NORM_RTOL}
    if "--float8" not in flags:
        return exact, exact
    if "--tp" in flags or "--cp" in flags:
        return SHARDED_FLOAT8_STEP1_RTOL, SHARDED_FLOAT8_RTOL
    return exact, FLOAT8_RTOL


def mismatch(root: Path, name: str, layouts: dict) -> str | None:
    """Why `name` does not match its reference (the first failed check), or None."""
    reference = layouts[name][0]
    candidate, single = root / name, root / reference
    first, later = tolerances(layouts[name][2])
    try:
        for key in ("train/loss", GRAD_NORM):
            new, ref = column(candidate, key), column(single, key)
            assert_series_close({1: new[1]}, {1: ref[1]}, rtol=first[key],
                                what=f"{key} at step 1")
            assert_series_close(new, ref, rtol=later[key], what=key)
        assert_norms_close(parameters(candidate), parameters(single), rtol=later["params"],
                           what="parameters after 5 AdamW steps")
        if layout_runs(root, {name: layouts[name]})[0]["routing"]:
            records = load_flips(candidate)
            assert records, "no routing was replayed"
            for record in records:
                assert record["max_margin"] <= TIE_MARGIN, f"routing differs: {record}"
    except AssertionError as error:
        return f"{name}: {error}"
    return None


def assert_all_match(root: Path, layouts: dict) -> None:
    for reference in {r for r, _, _ in layouts.values()}:
        losses = column(root / reference)
        assert len(losses) == 5 and losses[5] < losses[1], f"{reference} should make progress"
    failures = [m for m in (mismatch(root, name, layouts) for name in layouts) if m]
    assert not failures, "\n".join(failures)


@pytest.mark.multirank
def test_fast_layouts_match_one_process(tmp_path: Path) -> None:
    assert_all_match(train(tmp_path, FAST), FAST)


@pytest.mark.multirank
def test_compiled_checkpointed_layouts_match_one_process(tmp_path: Path) -> None:
    assert_all_match(train(tmp_path, COMPILED_AC), COMPILED_AC)


@pytest.mark.multirank
@pytest.mark.slow
def test_sweep_layouts_match_one_process(tmp_path: Path) -> None:
    assert_all_match(train(tmp_path, SWEEP), SWEEP)
