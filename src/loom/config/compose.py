"""Which parallelism features compose: the one refusal table validation raises from, which
docs/parallelism.md's composition matrix is generated from (`loom.config.matrix`).

Every refusal of a combination of features lives in `REFUSALS`; `refuse_combinations` is
what `loom.config.validate` calls, so the docs' matrix and the check are the same table.
Each pair of `FEATURES` is either refused here, exercised by the parity test `TESTED` names
(tests/unit/test_composition.py checks that the test exists and that validation accepts
the pair), or listed in `UNTESTED`: accepted by validation, without a parity test yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations

from loom.compat import (
    checkpoint_inside_compile_saves_mesh,
    torch_release,
    v_schedules_send_to_own_rank,
)
from loom.config.job import JobConfig
from loom.config.pipeline_layout import SPLIT_BACKWARD
from loom.errors import ConfigError

TORCH_CHECKED = "2.13"
"""The torch version the upstream reasons below were checked on."""

FEATURES: dict[str, dict[str, object]] = {
    "dp_shard": {"dp_shard": 2},
    "dp_replicate": {"dp_replicate": 2},
    "tp": {"tp": 2},
    "pp-1f1b": {"pp": 2, "pp_schedule": "1f1b"},
    "pp-interleaved": {"pp": 2, "pp_schedule": "interleaved-1f1b"},
    "cp": {"cp": 2},
    "ep": {"model": "moe-debug", "ep": 2},
    "simple-fsdp": {"data_parallel": "simple-fsdp"},
    "float8": {"float8": "tensorwise"},
    "fused-linear": {"loss_impl": "fused-linear"},
    "loss-parallel": {"loss_impl": "loss-parallel", "tp": 2},  # at tp 1 it runs "compiled"
    "compile": {"compile": True},
    "ac": {"activation_checkpoint": "block"},
}
"""Feature -> the flags (config_from_flags keys) that turn it on, at degree 2. loss-parallel
brings tp 2: at tp 1 it falls back to the compiled loss (`loom.losses.dispatch`)."""

SAME_FLAG = {frozenset(("pp-1f1b", "pp-interleaved")): "--pp-schedule",
             frozenset(("fused-linear", "loss-parallel")): "--loss-impl"}
"""Pairs that are two values of one flag: they cannot both be on."""


@dataclass(frozen=True)
class Refusal:
    """One refused combination: the matrix cells it covers, when it applies, the one-line
    error (it names the flags and what to do) and, for the docs, why."""

    cells: tuple[tuple[str, str], ...]
    applies: Callable[[JobConfig], bool]
    message: Callable[[JobConfig], str]
    why: str


def _cp(cfg: JobConfig) -> bool:
    return cfg.parallel.cp > 1


def _simple(cfg: JobConfig) -> bool:
    return cfg.parallel.data_parallel != "fsdp2"


def _float8(cfg: JobConfig) -> bool:
    return cfg.parallel.float8 != "off"


REFUSALS: tuple[Refusal, ...] = (
    Refusal((), lambda c: c.parallel.pp > 1 and c.parallel.pp_schedule in SPLIT_BACKWARD
            and v_schedules_send_to_own_rank(),
            lambda c: f"--pp-schedule {c.parallel.pp_schedule} needs torch 2.13 or newer: "
                      f"torch {torch_release()}'s V schedules send between a rank's own two "
                      "stages, which gloo cannot; use 1f1b or interleaved-1f1b",
            "--pp-schedule zero-bubble / dualpipev on torch 2.11-2.12 (`loom.compat."
            "v_schedules_send_to_own_rank`; fails on 2.11.0, runs on 2.13.0 and 2.15.0): the "
            "V's turn sends the activation from a rank to itself, which gloo refuses (`Pair "
            "is not connected`) in the first step's stage initialisation "
            "(tests/parity/test_upstream_zbv.py)"),
    Refusal((), lambda c: c.parallel.pp > 1 and c.parallel.pp_schedule in SPLIT_BACKWARD
            and c.parallel.ep > 1 and c.parallel.data_parallel == "fsdp2",
            lambda c: f"--pp-schedule {c.parallel.pp_schedule} with --ep {c.parallel.ep}: "
                      f"torch {torch_release()}'s split backward gets the weight gradients "
                      "of nested FSDP2 units (the routed experts) wrong; use 1f1b or "
                      "interleaved-1f1b",
            f"--pp-schedule zero-bubble / dualpipev with --ep under FSDP2: torch "
            f"{TORCH_CHECKED}'s split backward (stage_backward_input, then the deferred "
            "stage_backward_weight, as ScheduleZBVZeroBubble runs them) gives wrong weight "
            "gradients when a stage holds nested FSDP2 units, even on a one-rank dp mesh: "
            "worst relative error 1.0 and 2.9 against one process, while plain stages and "
            "one-unit FSDP2 stages match within 1e-7 (tests/parity/test_upstream_zbv.py). "
            "loom makes each such stage one FSDP2 unit (`loom.parallel.fsdp.one_unit`; "
            "tests/parity/test_pipeline_parity.py::test_v_schedules_match_one_process), "
            "but EP's routed experts are units of their own, over another mesh"),
    Refusal((), lambda c: c.parallel.compile and c.parallel.activation_checkpoint == "selective"
            and (_simple(c) or c.parallel.tp > 1) and checkpoint_inside_compile_saves_mesh(),
            lambda c: f"--compile with --ac selective at --tp {c.parallel.tp} (--data-parallel "
                      f"{c.parallel.data_parallel}) fails in torch {torch_release()}'s compiled "
                      "autograd; use --ac block or op (or --act-mem-budget)",
            "--compile with --ac selective under TP or SimpleFSDP, on torch 2.12-2.14 "
            "(`loom.compat.checkpoint_inside_compile_saves_mesh`; fails on 2.13.0, runs on "
            "2.11.0 and 2.15.0): AOT autograd saves the recomputed DTensor redistribution's "
            "DeviceMesh among the tensors (`expected all tensors_saved_with_vc_check to be "
            "Tensors`; torchtitan 0.2.2's own apply_tp + apply_ac + apply_compile fails the "
            "same way; tests/parity/test_upstream_compiled_ac.py). `--ac block` and `op` "
            "work around it there by checkpointing each compiled block whole "
            "(`loom.parallel.parallelize.checkpoint_outside_compile`); selective "
            "checkpoints the attention inside the compiled block, which has no such order"),
)

FAST_SWEEP = "tests/parity/test_layout_sweep.py::test_fast_layouts_match_one_process"
SLOW_SWEEP = "tests/parity/test_layout_sweep.py::test_sweep_layouts_match_one_process"
"""The layout sweep: 4-rank layouts that turn on several features each (its three eager
layouts run in the default selection, the others under slow)."""

TESTED: dict[frozenset[str], str] = {frozenset(pair): test for pair, test in {
    ("dp_shard", "dp_replicate"): "tests/parity/test_parity.py::test_layout_matches_single_process"
                                  "[hsdp2x2]",
    ("dp_shard", "tp"): "tests/parity/test_parity.py::test_layout_matches_single_process[dp2_tp2]",
    ("dp_shard", "pp-1f1b"): "tests/parity/test_pipeline_parity.py::"
                             "test_pipeline_layout_matches_single_process[pp2_dp2]",
    ("dp_shard", "pp-interleaved"): "tests/parity/test_pipeline_parity.py::"
                                    "test_interleaved_checkpoint_resumes_on_pp2_dp2",
    ("dp_shard", "cp"): "tests/parity/test_cp_parity.py::"
                        "test_slow_cp_layout_matches_single_process[cp2_dp2]",
    ("dp_shard", "ep"): "tests/parity/test_moe_parity.py::test_layout_matches_single_process[ep2]",
    ("dp_shard", "simple-fsdp"): "tests/parity/test_simple_fsdp_parity.py::"
                                 "test_matches_one_process_and_fsdp2[dp_shard4-eager]",
    ("dp_shard", "float8"): "tests/integration/test_float8_runs.py::"
                            "test_dp2_tensorwise_with_float8_all_gather_tracks_the_plain_run",
    ("dp_shard", "fused-linear"): "tests/integration/test_losses_multirank.py::"
                                  "test_five_step_losses_match_eager[dp2/fused-linear]",
    ("dp_shard", "compile"): "tests/integration/test_knobs.py::"
                             "test_compile_matches_plain_run[dp2-compile]",
    ("dp_shard", "ac"): "tests/integration/test_knobs.py::"
                        "test_activation_checkpointing_matches_plain_run[dp2-block]",
    ("dp_replicate", "cp"): "tests/parity/test_cp_parity.py::test_slow_cp_layout_matches_single_"
                            "process[cp2_hsdp]",
    ("dp_replicate", "ep"): "tests/parity/test_moe_parity.py::"
                            "test_slow_layout_matches_single_process[hsdp2x2_ep2]",
    ("dp_replicate", "simple-fsdp"): "tests/parity/test_simple_fsdp_parity.py::"
                                     "test_slow_cases_match_one_process[hsdp2x2-eager]",
    ("tp", "pp-1f1b"): "tests/parity/test_pipeline_parity.py::"
                       "test_pipeline_layout_matches_single_process[pp2_tp2]",
    ("tp", "cp"): "tests/parity/test_cp_parity.py::"
                  "test_slow_cp_layout_matches_single_process[cp2_tp2]",
    ("tp", "ep"): "tests/parity/test_moe_parity.py::test_layout_matches_single_process"
                  "[dp2_tp2_ep2_etp1]",
    ("tp", "simple-fsdp"): "tests/parity/test_simple_fsdp_parity.py::"
                           "test_slow_cases_match_one_process[dp2_tp2-eager]",
    ("tp", "fused-linear"): "tests/integration/test_losses_multirank.py::"
                            "test_five_step_losses_match_eager[tp2/fused-linear]",
    ("tp", "loss-parallel"): "tests/integration/test_losses_multirank.py::"
                             "test_five_step_losses_match_eager[tp2/loss-parallel]",
    ("tp", "compile"): "tests/integration/test_knobs.py::"
                       "test_compile_matches_plain_run[tp2-compile]",
    ("tp", "ac"): "tests/integration/test_knobs.py::"
                  "test_activation_checkpointing_matches_plain_run[tp2-block]",
    ("pp-1f1b", "ac"): "tests/parity/test_pipeline_parity.py::"
                       "test_pipeline_layout_matches_single_process_slow[pp2_ac]",
    ("cp", "simple-fsdp"): "tests/parity/test_cp_parity.py::"
                           "test_slow_cp_layout_matches_single_process[cp2_simple_fsdp]",
    ("cp", "ep"): "tests/parity/test_moe_parity.py::test_layout_matches_single_process[cp2_ep2]",
    ("cp", "fused-linear"): "tests/parity/test_cp_parity.py::test_cp_layout_matches_single_process"
                            "[cp2_fused_linear]",
    ("cp", "loss-parallel"): "tests/parity/test_cp_parity.py::test_slow_cp_layout_matches_single_"
                             "process[cp2_tp2_selective_ac]",
    ("cp", "compile"): "tests/parity/test_cp_parity.py::test_slow_cp_layout_matches_single_process"
                       "[cp2_compile]",
    ("cp", "ac"): "tests/parity/test_cp_parity.py::"
                  "test_slow_cp_layout_matches_single_process[cp2_ac]",
    ("ep", "simple-fsdp"): "tests/parity/test_simple_fsdp_parity.py::"
                           "test_matches_one_process_and_fsdp2[moe_ep2-eager]",
    ("ep", "compile"): "tests/parity/test_moe_parity.py::"
                       "test_slow_layout_matches_single_process[ep2_ac_compile]",
    ("ep", "ac"): "tests/parity/test_moe_parity.py::"
                  "test_slow_layout_matches_single_process[ep2_ac_compile]",
    ("simple-fsdp", "compile"): "tests/parity/test_simple_fsdp_parity.py::"
                                "test_matches_one_process_and_fsdp2[dp_shard4-compiled]",
    ("simple-fsdp", "ac"): "tests/parity/test_simple_fsdp_parity.py::"
                           "test_slow_cases_match_one_process[dp_shard4-ac]",
    ("tp", "pp-interleaved"): "tests/parity/test_pipeline_parity.py::test_pipeline_layout_"
                              "matches_single_process_slow[pp2_tp2_interleaved]",
    ("pp-1f1b", "ep"): "tests/parity/test_pipeline_parity.py::"
                       "test_moe_pp2_ep2_matches_single_process",
    ("pp-1f1b", "fused-linear"): "tests/parity/test_pipeline_parity.py::test_pipeline_layout_"
                                 "matches_single_process_slow[pp2_fused_linear]",
    ("pp-1f1b", "loss-parallel"): "tests/parity/test_pipeline_parity.py::"
                                  "test_pipeline_layout_matches_single_process_slow"
                                  "[pp2_tp2_loss_parallel]",
    ("pp-interleaved", "ac"): "tests/parity/test_pipeline_parity.py::test_pipeline_layout_"
                              "matches_single_process_slow[pp2_interleaved_ac]",
    ("dp_replicate", "compile"): "tests/parity/test_simple_fsdp_parity.py::test_slow_cases_"
                                 "match_one_process[hsdp2x2-compiled]",
    ("loss-parallel", "ac"): "tests/parity/test_cp_parity.py::test_slow_cp_layout_matches_single_"
                             "process[cp2_tp2_selective_ac]",
    ("compile", "ac"): "tests/parity/test_moe_parity.py::"
                       "test_slow_layout_matches_single_process[ep2_ac_compile]",
    **{pair: FAST_SWEEP for pair in (
        ("dp_replicate", "tp"), ("dp_replicate", "loss-parallel"), ("dp_replicate", "ac"),
        ("dp_shard", "loss-parallel"), ("simple-fsdp", "loss-parallel"), ("pp-1f1b", "cp"))},
    **{pair: SLOW_SWEEP for pair in (
        ("dp_replicate", "pp-1f1b"), ("dp_replicate", "pp-interleaved"),
        ("dp_replicate", "float8"), ("dp_replicate", "fused-linear"),
        ("pp-1f1b", "float8"), ("pp-1f1b", "compile"),
        ("pp-interleaved", "ep"), ("pp-interleaved", "float8"),
        ("pp-interleaved", "fused-linear"), ("pp-interleaved", "loss-parallel"),
        ("pp-interleaved", "compile"), ("ep", "float8"),
        ("ep", "fused-linear"), ("ep", "loss-parallel"), ("simple-fsdp", "fused-linear"),
        ("float8", "fused-linear"), ("float8", "compile"), ("float8", "ac"),
        ("fused-linear", "compile"), ("fused-linear", "ac"), ("loss-parallel", "compile"),
        ("tp", "float8"), ("float8", "loss-parallel"), ("simple-fsdp", "float8"),
        ("cp", "float8"), ("pp-1f1b", "simple-fsdp"), ("pp-interleaved", "simple-fsdp"),
        ("pp-interleaved", "cp"))},
}.items()}
"""Pair -> the test that runs it (a node id; the test checks it is collected)."""

UNTESTED: frozenset[frozenset[str]] = frozenset()
"""Pairs validation accepts that no parity test runs yet: the gaps, named (a new test
moves its pair to `TESTED`)."""


_DEEPSEEK = "tests/parity/test_deepseek_v3_parity.py::"
_DEEPSEEK_FLOAT8 = ("tests/parity/test_deepseek_v3_float8.py::"
                    "test_float8_layout_matches_float8_single_process")
_MTP_PP = "tests/parity/test_deepseek_v3_mtp_pipeline.py::"
_MTP_LOSS = "tests/parity/test_deepseek_v3_mtp_losses.py::test_mtp_loss_mode_matches_single_process"
_MTP_LOSS_SLOW = ("tests/parity/test_deepseek_v3_mtp_losses.py::"
                  "test_slow_mtp_loss_mode_matches_single_process")
FAMILY_LAYOUTS: dict[str, dict[str, str]] = {
    "deepseek-v3": {
        "ep": f"{_DEEPSEEK}test_layout_matches_single_process[ep2]",
        "tp": f"{_DEEPSEEK}test_layout_matches_single_process[tp2]",
        "pp-1f1b": f"{_DEEPSEEK}test_pp2_matches_single_process",
        "ep (4 ranks)": f"{_DEEPSEEK}test_slow_layout_matches_single_process[ep4]",
        "tp + ep": f"{_DEEPSEEK}test_slow_layout_matches_single_process[tp2_ep2]",
        "tp + ep + etp": f"{_DEEPSEEK}test_slow_layout_matches_single_process[tp2_ep2_etp2]",
        "dp_shard": f"{_DEEPSEEK}test_layout_matches_single_process[dp2]",
        "pp-1f1b + ep": f"{_DEEPSEEK}test_slow_pp2_ep2_matches_single_process",
        "pp-interleaved-1f1b": f"{_DEEPSEEK}test_slow_pp2_schedule_matches_single_process"
                               "[interleaved-1f1b]",
        "pp-zero-bubble": f"{_DEEPSEEK}test_slow_pp2_schedule_matches_single_process"
                          "[zero-bubble]",
        "pp-dualpipev": f"{_DEEPSEEK}test_slow_pp2_schedule_matches_single_process[dualpipev]",
        "cp": f"{_DEEPSEEK}test_slow_layout_matches_single_process[cp2]",
        "simple-fsdp + ep": f"{_DEEPSEEK}test_slow_layout_matches_single_process"
                            "[simple_fsdp_ep2]",
        "ep + block ac + compile": f"{_DEEPSEEK}test_slow_layout_matches_single_process"
                                   "[ep2_ac_compile]",
        "tp + ep + op ac + compile": f"{_DEEPSEEK}test_slow_layout_matches_single_process"
                                     "[tp2_ep2_op_ac_compile]",
        "tp + ep + etp + block ac + compile": f"{_DEEPSEEK}test_slow_layout_matches_single_"
                                              "process[tp2_ep2_etp2_ac_compile]",
        "float8 + ep": f"{_DEEPSEEK_FLOAT8}[float8_ep2]",
        "float8 + dp_shard + tp": f"{_DEEPSEEK_FLOAT8}[float8_dp2_tp2]",
        "MTP + ep": f"{_DEEPSEEK}test_layout_matches_single_process[mtp_ep2]",
        "MTP + tp": f"{_DEEPSEEK}test_layout_matches_single_process[mtp_tp2]",
        "MTP + tp + ep": f"{_DEEPSEEK}test_slow_layout_matches_single_process[mtp_tp2_ep2]",
        "MTP + pp-1f1b": f"{_DEEPSEEK}test_mtp_pp2_matches_single_process",
        "MTP + pp-interleaved-1f1b": f"{_DEEPSEEK}test_slow_mtp_pp2_interleaved_matches_"
                                     "single_process",
        "MTP + pp-1f1b + tp": f"{_DEEPSEEK}test_slow_mtp_pp2_tp2_matches_single_process",
        "MTP + cp": f"{_DEEPSEEK}test_layout_matches_single_process[mtp_cp2]",
        "MTP + cp + dp_shard": f"{_DEEPSEEK}test_slow_layout_matches_single_process"
                               "[mtp_cp2_dp2]",
        "dp_replicate + dp_shard": f"{_DEEPSEEK}test_slow_layout_matches_single_process"
                                   "[hsdp2x2]",
        "LoRA + dp_shard": f"{_DEEPSEEK}test_layout_matches_single_process[lora_dp2]",
        "Hugging Face folder, tp + ep": f"{_DEEPSEEK}test_imported_folder_trains_at_tp2_ep2_"
                                        "like_one_process",
        "MTP + pp-1f1b + cp": f"{_MTP_PP}test_slow_mtp_pp2_cp2_matches_single_process",
        "MTP + pp-zero-bubble": f"{_MTP_PP}test_slow_mtp_pp2_v_schedule_matches_single_"
                                "process[zero-bubble]",
        "MTP + pp-dualpipev": f"{_MTP_PP}test_slow_mtp_pp2_v_schedule_matches_single_"
                              "process[dualpipev]",
        "MTP + pp-dualpipev + cp": f"{_MTP_PP}test_slow_mtp_pp2_v_schedule_matches_single_"
                                   "process[dualpipev_cp2]",
        "MTP + fused-linear + dp_shard": f"{_MTP_LOSS}[fused_linear_dp2]",
        "MTP + chunked + dp_shard": f"{_MTP_LOSS}[chunked_dp2]",
        "MTP + loss-parallel + tp": f"{_MTP_LOSS}[loss_parallel_tp2]",
        "MTP + doc-mask + cp": f"{_MTP_LOSS}[doc_mask_cp2]",
        "MTP + fused-linear + tp": f"{_MTP_LOSS_SLOW}[fused_linear_tp2]",
        "MTP + doc-mask + fused-linear + tp": f"{_MTP_LOSS_SLOW}[doc_mask_fused_linear_tp2]",
    },
}
"""Family -> layout -> the parity test that runs it on that family's own modules (the
matrix above runs loom's dense and MoE models; a family with its own attention or heads
names its layouts here)."""

FAMILY_REFUSALS: dict[str, tuple[str, ...]] = {
    "deepseek-v3": ("multi-token prediction with `--doc-mask` under `--pp` "
                    "(`DeepseekV3Flags.check`): its first stage's forward fails at the second "
                    "step, not yet understood",),
}
"""Family -> the layouts and losses it refuses in one line, and why."""


def refusal_for(cfg: JobConfig) -> Refusal | None:
    """The first table entry that refuses this configuration, or None."""
    return next((r for r in REFUSALS if r.applies(cfg)), None)


def refuse_combinations(cfg: JobConfig) -> None:
    """Raise the first refused combination as one line (before any collective)."""
    refusal = refusal_for(cfg)
    if refusal is not None:
        raise ConfigError(refusal.message(cfg))


def pairs() -> list[tuple[str, str]]:
    return list(combinations(FEATURES, 2))


def cell(a: str, b: str) -> tuple[str, str]:
    """(status, detail): same-flag, refused (why), tested (the test) or untested."""
    pair = frozenset((a, b))
    if pair in SAME_FLAG:
        return "same flag", f"two values of {SAME_FLAG[pair]}"
    for refusal in REFUSALS:
        if (a, b) in refusal.cells or (b, a) in refusal.cells:
            return "refused", refusal.why
    if pair in TESTED:
        return "composes", TESTED[pair]
    return "untested", "accepted; no parity test yet"
