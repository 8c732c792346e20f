"""The parity test that runs each layout a family declares on its spec (`ModelSpec.layouts`):
test node ids live with the tests, the layouts with the family
(tests/unit/config/test_composition.py checks the two agree and that each test is collected)."""

from __future__ import annotations

_DEEPSEEK = "tests/parity/test_deepseek_v3_parity.py::"
_DEEPSEEK_FLOAT8 = ("tests/parity/test_deepseek_v3_float8.py::"
                    "test_float8_layout_matches_float8_single_process")
_MTP_PP = "tests/parity/test_deepseek_v3_mtp_pipeline.py::"
_MTP_LOSS = "tests/parity/test_deepseek_v3_mtp_losses.py::test_mtp_loss_mode_matches_single_process"
_MTP_LOSS_SLOW = ("tests/parity/test_deepseek_v3_mtp_losses.py::"
                  "test_slow_mtp_loss_mode_matches_single_process")
_GPT2 = "tests/integration/test_custom_family.py::"
FAMILY_LAYOUT_TESTS: dict[str, dict[str, str]] = {
    "gpt2-test": {
        "dp_shard": f"{_GPT2}test_test_family_trains_like_one_process[dp2]",
        "tp": f"{_GPT2}test_test_family_trains_like_one_process[tp2]",
        "pp-1f1b": f"{_GPT2}test_test_family_trains_like_one_process[pp2]",
        "dp_shard checkpoint resumed at tp": f"{_GPT2}test_test_family_checkpoints_its_own_"
                                              "arguments_and_resumes_at_another_layout",
    },
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
"""Family -> layout (as its spec names it) -> the parity test that runs it against one
process on that family's own modules."""
