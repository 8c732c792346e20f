"""What the docs say is refused is refused, and what they say runs is accepted.

One row per claim: the page, the phrase that makes it (checked to be still there, so a row
cannot outlive its sentence), the flags that exercise it, the world size (None: no layout
check) and the verdict. The verdict is validation's: the flags parsed and validated as
`loom train` does, the layout checked at the world size, and where a refusal is given later
(`loom plan`'s own, start-up's for CUDA graphs) that check: cheap, no training (each "runs"
claim's parity test is named beside it in the docs and in `loom.config.compose`). A
refusal upstream torch fixes in some releases names the `loom.compat` check that says where
it applies.

The composition matrix in docs/parallelism.md has its own test
(tests/unit/config/test_composition.py), generated from the same refusal table.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from loom.compat import checkpoint_inside_compile_saves_mesh, v_schedules_send_to_own_rank
from loom.config import ConfigError, parse_args
from loom.parallel.cuda_graphs import cuda_graphs_refusal
from loom.parallel.mesh import ParallelDims
from loom.plan.command import check_supported
from tests.harness import REPO

REFUSED, RUNS = "refused", "runs"
DEBUG = ["--model", "debug", "--dataset", "random"]
MOE = ["--model", "moe-debug", "--dataset", "random", "--dtype", "bf16"]


@dataclass(frozen=True)
class Claim:
    page: str
    phrase: str
    flags: list[str]
    world: int | None
    """The ranks the layout is checked at (None: one)."""
    says: str
    where: Callable[[], bool] | None = None
    """The releases a version-bound refusal applies to (elsewhere the flags run)."""
    stage: str = "validate"
    """Where the verdict is given: "validate"; "plan", `loom plan`'s own `check_supported`;
    "cuda-graphs", start-up's `cuda_graphs_refusal` on a CUDA device (it needs the device
    and the layout, so `loom.trainer.resolve` asks it after validation)."""

    def expected(self) -> str:
        if self.says == REFUSED and self.where is not None and not self.where():
            return RUNS
        return self.says


CLAIMS = [
    # parallelism.md
    Claim("parallelism.md", "`--n-heads` or `--n-kv-heads` not divisible by tp",
          [*DEBUG, "--tp", "3"], 3, REFUSED),
    Claim("parallelism.md", "`--seq-len` not divisible by tp",
          [*DEBUG, "--tp", "2", "--seq-len", "255"], 2, REFUSED),
    Claim("parallelism.md", "`--compile` with `--ac selective` at tp > 1 on torch 2.12-2.14",
          [*DEBUG, "--tp", "2", "--compile", "--ac", "selective"], 2, REFUSED,
          checkpoint_inside_compile_saves_mesh),
    Claim("parallelism.md", "| `--data-parallel simple-fsdp` | TP, EP, HSDP, CP, PP, AC, "
          "compile | transformers' module (below); `--compile` with `--ac selective` on torch "
          "2.12-2.14", [*DEBUG, "--data-parallel", "simple-fsdp", "--compile", "--ac",
                        "selective"], 2, REFUSED, checkpoint_inside_compile_saves_mesh),
    Claim("parallelism.md", "`--ac block` and `op` with `--compile` run at `--tp > 1`",
          [*DEBUG, "--tp", "2", "--compile", "--ac", "block"], 2, RUNS),
    Claim("parallelism.md", "`--ac block` and `op` with `--compile` run at `--tp > 1`",
          [*DEBUG, "--tp", "2", "--compile", "--ac", "op"], 2, RUNS),
    Claim("parallelism.md", "dp 2 × tp 2 × `--ac block` × `--compile` matches one process",
          [*DEBUG, "--data-parallel", "simple-fsdp", "--dp-shard", "2", "--tp", "2", "--ac",
           "block", "--compile"], 4, RUNS),
    Claim("parallelism.md", "--pp-schedule zero-bubble / dualpipev on torch 2.11-2.12",
          [*DEBUG, "--pp", "2", "--pp-schedule", "zero-bubble"], 2, REFUSED,
          v_schedules_send_to_own_rank),
    Claim("parallelism.md", "EP's routed experts are FSDP2 units of their own, so `--ep` with "
          "them is refused under FSDP2", [*MOE, "--pp", "2", "--pp-schedule", "dualpipev",
                                           "--ep", "2"], 4, REFUSED),
    Claim("parallelism.md", "Refused in one line (exit 2): a `--seq-len` not divisible by 2 x "
          "cp", [*DEBUG, "--cp", "2", "--seq-len", "250"], 2, REFUSED),
    Claim("parallelism.md", "`--tp > 1` with `--loss-impl fused-linear` or `loss-parallel` "
          "runs", [*DEBUG, "--pp", "2", "--tp", "2", "--loss-impl", "fused-linear"], 4, RUNS),
    Claim("parallelism.md", "`--tp > 1` with `--loss-impl fused-linear` or `loss-parallel` "
          "runs", [*DEBUG, "--pp", "2", "--tp", "2", "--loss-impl", "loss-parallel"], 4, RUNS),
    # performance.md
    Claim("performance.md", "`--compile` with `--ac selective` at `--tp > 1` (or under "
          "SimpleFSDP) fails in AOTAutograd on torch 2.12-2.14",
          [*DEBUG, "--tp", "2", "--compile", "--ac", "selective"], 2, REFUSED,
          checkpoint_inside_compile_saves_mesh),
    Claim("performance.md", "`--compile` with `--ac block` or `op` at `--tp > 1` runs",
          [*DEBUG, "--tp", "2", "--compile", "--ac", "block"], 2, RUNS),
    Claim("performance.md", "`--compile --act-mem-budget 0.5` at tp 2 works",
          [*DEBUG, "--tp", "2", "--compile", "--act-mem-budget", "0.5"], 2, RUNS),
    Claim("performance.md", "`--float8-emulate` without `--float8` is refused",
          [*DEBUG, "--float8-emulate"], None, REFUSED),
    Claim("performance.md", "refused in one line where it cannot apply: without `--compile`",
          [*DEBUG, "--cuda-graphs"], None, REFUSED, stage="cuda-graphs"),
    Claim("performance.md", "at world size > 1", [*DEBUG, "--cuda-graphs", "--compile"], 2,
          REFUSED, stage="cuda-graphs"),
    Claim("performance.md", "`--cuda-graphs` records a static single-device compiled step as "
          "CUDA graphs", [*DEBUG, "--cuda-graphs", "--compile"], 1, RUNS,
          stage="cuda-graphs"),
    # training.md
    Claim("training.md", "Refused in one line: `--float8` (both swap the same linears)",
          [*DEBUG, "--lora-rank", "8", "--dtype", "bf16", "--float8", "tensorwise"], None,
          REFUSED),
    Claim("training.md", "`--data-parallel simple-fsdp`, `--pp > 1` and transformers' module",
          [*DEBUG, "--lora-rank", "8", "--data-parallel", "simple-fsdp"], None, REFUSED),
    Claim("training.md", "`--data-parallel simple-fsdp`, `--pp > 1` and transformers' module",
          [*DEBUG, "--lora-rank", "8", "--pp", "2"], 2, REFUSED),
    Claim("training.md", "compiled tp 2 match one process",
          [*DEBUG, "--lora-rank", "8", "--tp", "2", "--compile"], 2, RUNS),
    Claim("training.md", "A `--muon-*` flag without `--optimizer muon` is refused",
          [*DEBUG, "--muon-ns-steps", "3"], None, REFUSED),
    # trust.md
    Claim("trust.md", "a width, length or degree past what any model has (`--dim 2**40`",
          [*DEBUG, "--dim", str(2**40)], None, REFUSED),
    Claim("trust.md", "`--lora-rank 100000000` | refused by its range",
          [*DEBUG, "--lora-rank", "100000000"], None, REFUSED),
    Claim("trust.md", "`--gc-every -1`, `--comm-timeout-s 1e300`, `--sigterm-grace-s` past a "
          "year | refused", [*DEBUG, "--gc-every", "-1"], None, REFUSED),
    Claim("trust.md", "`--gc-every -1`, `--comm-timeout-s 1e300`, `--sigterm-grace-s` past a "
          "year | refused", [*DEBUG, "--comm-timeout-s", "1e300"], None, REFUSED),
    Claim("trust.md", "`--gc-every -1`, `--comm-timeout-s 1e300`, `--sigterm-grace-s` past a "
          "year | refused", [*DEBUG, "--sigterm-grace-s", str(366 * 86400)], None, REFUSED),
    Claim("trust.md", "`--rope-factor 8` with `--rope-high-freq-factor` not above "
          "`--rope-low-freq-factor`", [*DEBUG, "--rope-factor", "8", "--rope-low-freq-factor",
                                       "2", "--rope-high-freq-factor", "2"], None, REFUSED),
    # planning.md: loom plan's own refusals
    Claim("planning.md", "fp32 experts are refused", [*MOE, "--dtype", "fp32"], 2, REFUSED,
          stage="plan"),
    Claim("planning.md", "Pipeline: `--pp` with MoE models is refused",
          [*MOE, "--pp", "2"], 2, REFUSED, stage="plan"),
]


def page_text(page: str) -> str:
    """The page with its line breaks and runs of spaces as single spaces, so a phrase
    wrapped across lines is found."""
    return re.sub(r"\s+", " ", (REPO / "docs" / page).read_text())


def verdict(claim: Claim) -> str:
    try:
        cfg = parse_args(claim.flags)
        dims = ParallelDims.from_config(cfg.parallel, claim.world or 1)
        if claim.stage == "plan":
            check_supported(cfg)
        if claim.stage == "cuda-graphs" and cuda_graphs_refusal(cfg, dims, "cuda"):
            return REFUSED
    except ConfigError:
        return REFUSED
    return RUNS


@pytest.mark.parametrize("claim", CLAIMS, ids=[f"{c.page}:{' '.join(c.flags[2:])}"
                                               for c in CLAIMS])
def test_the_docs_say_what_validation_does(claim: Claim) -> None:
    assert claim.phrase in page_text(claim.page), f"{claim.page} no longer says {claim.phrase!r}"
    assert verdict(claim) == claim.expected(), claim


def test_every_page_named_exists() -> None:
    assert all(Path(REPO / "docs" / c.page).is_file() for c in CLAIMS)
