"""MoE parity: the same seed and global batch on 1 process and under expert parallel (with
FSDP, TP, ETP, CP, HSDP, AC + compile) and MoE + TP alone give the same per-step losses,
gradient norms, routing counts and final parameters (fp32). At --etp 1 the ep group spans
dp_shard x cp x tp ranks (tp first), at --etp tp it spans dp_shard x cp.

Losses alone would miss a wrong expert-gradient scale (AdamW normalises it away); the
pre-clip gradient norms and the final parameters do not.

Every layout replays its single-process run's routing (tests/routing.py): a token whose two
best experts tie within rounding noise may otherwise choose differently in another layout,
and one such token moves a step's gradient norm by ~1e-3 (seen on an Intel Xeon with AMX).
The tokens whose own choice differed are counted; each must be a near tie (`TIE_MARGIN`),
so a routing bug still fails here instead of being replayed away.

`aux_cp2_ep2` trains with the sequence-wise balance loss (--aux-loss-coeff) at dp 2 x cp 2
x ep 2 against its own single process (`aux_single`): each cp rank holds half of every
sequence, so the loss's per-sequence sums are summed over cp (with gradient) before it is
formed. Its `moe/aux_loss` must match too. Measured with that sum dropped (each rank's loss
over its own chunks): aux_loss off by 1.3e-3 and step 2's loss by 2.9e-5; with the sum's
backward not summing (the aux gradient halved): step 1's gradient norm off by 1.6e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.compare import assert_norms_close, assert_series_close, column, rows
from tests.harness import run_ranks
from tests.routing import load_flips

GLOBAL_BATCH = 4
COMMON = ["--model", "moe-debug", "--dataset", "random", "--vocab-size", "512",
          "--seq-len", "64", "--fp32", "--max-steps", "5", "--seed", "7", "--lr", "1e-3",
          "--warmup-steps", "0"]
RTOL = 1e-5
"""Losses: every layout's are within 3.0e-7 of its reference on every CPU kernel set
measured (see GRAD_NORM_RTOL); a wrong expert scale or dispatch moves them by ~1e-2."""
FIRST_GRAD_NORM_RTOL = 1e-6
"""Step 1's pre-clip gradient norm, taken at the same initial weights in every layout, so it
differs only by one backward's summation order: measured worst 2.3e-7 (see GRAD_NORM_RTOL),
4x below this. A wrong expert-gradient scale or a missing reduction is off by percent."""
GRAD_NORM_RTOL = 5e-5
"""Steps 2-5: each follows AdamW updates of weights that already differ by rounding, and
AdamW turns a rounding difference on a near-zero gradient into a ~lr step, so the spread
grows step by step (worst at step 5 in every case). Derived from a measured spread, not set
by hand: `python -m tests.moe_spread` trains every multi-rank MoE comparison of the suite
(this file, test_simple_fsdp_experts.py, test_compiled_moe_parity.py, and the pp2 x ep2
case of test_pipeline_parity.py) under each ATEN_CPU_CAPABILITY and reports each layout's
relative difference from its reference. On an Intel Xeon with AMX (family 6 model 167),
19 layouts x {default, avx2, avx512}: worst 1.10e-5 (avx512, SimpleFSDP few_hsdp2_ep2, step
5), steps 2-4 at most 1.2e-6, losses at most 3.0e-7, final parameters at most 3.8e-5 of
their norm; one process against itself under another capability, up to 3.1e-6. The
two-expert top-1 runs spread most (a token's one expert carries its whole gradient). The
allowance is ~4.5x that worst case; an error in the updates themselves (a wrong scale, a
dropped reduction) already shows at step 1."""
PARAM_NORM_RTOL = 1e-3
"""Per tensor, as in test_parity.py: AdamW can turn a reduction-order difference on a ~0
gradient into a 2 * lr step on one element, so final parameters are compared norm-wise."""
GRAD_NORM = "grad/norm_preclip"
TIE_MARGIN = 1e-4
"""The largest score gap a layout's own choice may cross: fp32 scores of a few hundred
terms differ by ~1e-6 between reduction orders (the flips seen had gaps of 2.8e-6, 3.0e-6);
a wrong router or dispatch gives gaps of ~1e-2 and more."""
MAX_FLIPS = 2
"""Near ties that flipped, per forward, router and dp rank (seen: at most 1)."""
COMPILE = ["--compile", "--compile-backend", "aot_eager"]
AUX = ["--aux-loss-coeff", "0.01"]
FEW_EXPERTS = ["--n-experts", "2", "--top-k", "1"]
"""Fewer (local) experts than FSDP shard ranks: the stacked expert weights are sharded off
dim 0 (`expert_placement`). Compared with their own single-process run (`few_single`)."""

LAYOUTS = {  # name: (world size, dp degree, flags)
    "single": (1, 1, []),
    "ep2": (4, 4, ["--ep", "2"]),
    "dp2_tp2_ep2_etp1": (4, 2, ["--tp", "2", "--ep", "2", "--etp", "1"]),
    "tp2_ep4_etp1": (4, 2, ["--tp", "2", "--ep", "4", "--etp", "1"]),
    "cp2_ep2": (4, 2, ["--cp", "2", "--ep", "2"]),
    "few_single": (1, 1, FEW_EXPERTS),
    "aux_single": (1, 1, AUX),
    "aux_cp2_ep2": (4, 2, ["--cp", "2", "--ep", "2", *AUX]),
}
SINGLES = ("single", "few_single", "aux_single")
SLOW_LAYOUTS = {
    "dp2_tp2_etp1": (4, 2, ["--tp", "2"]),
    "dp2_tp2_ep2_etp2": (4, 2, ["--tp", "2", "--ep", "2", "--etp", "2"]),
    "hsdp2x2_ep2": (4, 4, ["--dp-replicate", "2", "--dp-shard", "2", "--ep", "2"]),
    "cp2_tp2_ep4": (4, 1, ["--cp", "2", "--tp", "2", "--ep", "4"]),
    "ep2_ac_compile": (4, 4, ["--ep", "2", "--ac", "block", *COMPILE]),
    "few_dp4": (4, 4, FEW_EXPERTS),
    "dp2_tp2_ep2_etp1_compile": (4, 2, ["--tp", "2", "--ep", "2", *COMPILE]),
    "ep4": (4, 4, ["--ep", "4"]),
    "dp2_tp2_etp2": (4, 2, ["--tp", "2", "--etp", "2"]),
    "few_ep2": (4, 4, [*FEW_EXPERTS, "--ep", "2"]),
}
"""Layouts beyond the default selection's four compositions (ep over dp, ep with tp, ep
spanning tp, ep with cp, and resumes between them): each trains in a 4-rank job of its
own under slow, replaying its single-process reference's routing, to keep the default
selection within its budget (tests/moe_spread.py trains them all)."""


def reference_of(layout: str) -> str:
    for family in ("few", "aux"):
        if layout.startswith(f"{family}_"):
            return f"{family}_single"
    return "single"


def launch(world: int, layouts: dict, root: Path, references: Path | None = None,
           more: list[list[str]] = ()) -> None:
    """Single-process runs record their routing; the others replay their reference's (from
    `references`, default `root`). `more` runs after them in the same job, routing freely."""
    references = references or root
    runs = [{"argv": [*COMMON, *flags, "--batch-size", str(GLOBAL_BATCH // dp), "--outdir",
                      str(root / name)],
             "routing": "record" if name in SINGLES else str(references / reference_of(name))}
            for name, (size, dp, flags) in layouts.items() if size == world]
    runs += more
    job = run_ranks(world, ["tests/workers/parity_worker.py", json.dumps(runs), "--shares"],
                    timeout=1200)
    assert job.ok, job.describe()


def assert_flips_are_ties(candidate: Path) -> None:
    """The tokens a layout would have routed differently from its reference were near ties,
    and few; each (forward, router, dp rank, cp rank) is counted once (tp ranks repeat
    it)."""
    records = {(r["forward"], r["router"], r["dp_rank"], r["cp_rank"]): r
               for r in load_flips(candidate)}
    assert records, f"{candidate.name}: no routing was replayed"
    for (forward, router, dp_rank, cp_rank), r in sorted(records.items()):
        where = f"{candidate.name} forward {forward} {router} dp rank {dp_rank} cp {cp_rank}"
        assert r["max_margin"] <= TIE_MARGIN, (
            f"{where}: {r['tokens']} tokens chose other experts with a score gap up to "
            f"{r['max_margin']:.3g} (> {TIE_MARGIN:g}): not rounding, a routing difference")
        assert r["tokens"] <= MAX_FLIPS, f"{where}: {r['tokens']} of {r['rows']} tokens flipped"


def assert_losses_and_grad_norms_close(candidate: Path, reference: Path) -> None:
    """Losses within RTOL at every step; pre-clip gradient norms within
    FIRST_GRAD_NORM_RTOL at step 1 and GRAD_NORM_RTOL after it."""
    assert_series_close(column(candidate), column(reference), rtol=RTOL, what="train/loss")
    new, ref = column(candidate, GRAD_NORM), column(reference, GRAD_NORM)
    assert_series_close(new, ref, rtol=GRAD_NORM_RTOL, what=GRAD_NORM)
    assert_series_close({1: new[1]}, {1: ref[1]}, rtol=FIRST_GRAD_NORM_RTOL,
                        what=f"{GRAD_NORM} at step 1")


def assert_same_steps(candidate: Path, reference: Path) -> None:
    """Per step: losses and pre-clip gradient norms close, routing counts equal, and the
    balance loss close where the reference trains with one."""
    assert_losses_and_grad_norms_close(candidate, reference)
    ref, new = rows(reference), rows(candidate)
    assert len(new) == len(ref) == 5
    for key in ("moe/tokens_per_expert_min", "moe/tokens_per_expert_max"):
        assert [r[key] for r in new] == [r[key] for r in ref], key
    if "moe/aux_loss" in ref[0]:
        assert_series_close(column(candidate, "moe/aux_loss"), column(reference, "moe/aux_loss"),
                            rtol=RTOL, what="moe/aux_loss")


def assert_same_run(candidate: Path, reference: Path) -> None:
    assert_flips_are_ties(candidate)
    assert_same_steps(candidate, reference)
    assert_norms_close(torch.load(candidate / "params.pt"), torch.load(reference / "params.pt"),
                       rtol=PARAM_NORM_RTOL, what="parameters after 5 AdamW steps")


def train_layouts(root: Path) -> Path:
    """Every layout of LAYOUTS, and the resume runs, trained into `root`."""
    launch(1, LAYOUTS, root)
    launch(4, LAYOUTS, root, more=resume_runs(root / "resume"))
    return root


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory) -> Path:
    return train_layouts(tmp_path_factory.mktemp("moe_parity"))


@pytest.mark.multirank
def test_single_process_reference_trains(moe_runs: Path) -> None:
    losses = column(moe_runs / "single")
    assert losses[5] < losses[1], "training should make progress"


@pytest.mark.multirank
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name not in SINGLES])
def test_layout_matches_single_process(moe_runs: Path, layout: str) -> None:
    assert_same_run(moe_runs / layout, moe_runs / reference_of(layout))


HOLDERS = {"tp2_ep4_etp1": 4, "cp2_tp2_ep4": 4, "dp2_tp2_ep2_etp1": 4, "hsdp2x2_ep2": 2}
"""Layout -> how many ranks split each routed expert weight."""


def assert_expert_shares(run: Path, holders: int) -> None:
    shares = json.loads((run / "shares.json").read_text())
    params = torch.load(run / "params.pt")
    layout = run.name
    experts = {n: s for n, s in shares.items() if ".moe.experts.w" in n}
    assert experts, sorted(shares)
    for name, per_rank in experts.items():
        print(f"{layout} {name}: {per_rank} of {params[name].numel()} elements per rank")
        assert per_rank == [params[name].numel() // holders] * 4, (name, per_rank)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", [name for name in HOLDERS if name in LAYOUTS])
def test_each_rank_holds_its_share_of_the_experts(moe_runs: Path, layout: str) -> None:
    """At --tp 2 --ep 4 --etp 1 on 4 ranks every rank holds a quarter of each routed expert
    weight (ep spans the tp ranks), not half (as when ep only borrowed dp_shard ranks and tp
    ranks held replicas); HSDP keeps one copy per replica."""
    assert_expert_shares(moe_runs / layout, HOLDERS[layout])


RESUME_RTOL = 1e-4
"""Resumed runs route by themselves (no reference recorded beyond step 5), so a near tie
may flip; losses still agree to ~1e-6, a wrongly resharded expert moves them by ~1e-2."""
RESUMED = ("tp2_ep4_etp1", "cp2_ep2")


def resume_runs(root: Path) -> list[list[str]]:
    """10 steps at --ep 2 over dp_shard (the layout loom used before ep spanned tp and cp);
    5 saved there, resumed to 10 at --tp 2 --ep 4 and at --cp 2 --ep 2."""
    def argv(name: str, *flags: str) -> list[str]:
        _, dp, layout = LAYOUTS[name]
        return [*COMMON, *layout, "--batch-size", str(GLOBAL_BATCH // dp), *flags]

    step5 = root / "ep2-saved" / "checkpoints" / "step-5"
    return [argv("ep2", "--max-steps", "10", "--outdir", str(root / "straight")),
            argv("ep2", "--checkpoint-interval", "5", "--outdir", str(root / "ep2-saved")),
            *(argv(name, "--max-steps", "10", "--resume", str(step5), "--outdir",
                   str(root / name)) for name in RESUMED)]


@pytest.mark.multirank
@pytest.mark.parametrize("layout", RESUMED)
def test_checkpoints_resume_across_ep_degrees_and_layouts(moe_runs: Path, layout: str) -> None:
    straight = column(moe_runs / "resume" / "straight")
    resumed = column(moe_runs / "resume" / layout)
    assert sorted(resumed) == list(range(6, 11))
    assert_series_close(resumed, {s: straight[s] for s in resumed}, rtol=RESUME_RTOL,
                        what=f"{layout} resumed from ep2")


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(SLOW_LAYOUTS))
def test_slow_layout_matches_single_process(moe_runs: Path, tmp_path: Path, layout: str) -> None:
    launch(4, {layout: SLOW_LAYOUTS[layout]}, tmp_path, references=moe_runs)
    assert_same_run(tmp_path / layout, moe_runs / reference_of(layout))
    if layout in HOLDERS:
        assert_expert_shares(tmp_path / layout, HOLDERS[layout])
