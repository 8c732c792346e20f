"""The pipeline's layout without a process group: the split, the stages a rank holds, the
micro-batch count and the flag combinations refused at validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loom.compat import v_schedules_send_to_own_rank
from loom.config import ConfigError, ParallelConfig, config_from_flags
from loom.config.pipeline_layout import (
    balanced_split,
    bubble_fraction,
    choose_microbatches,
    stage_indices,
)
from loom.models.llama.model import ModelArgs, Transformer
from loom.parallel.fsdp import one_unit
from loom.parallel.pipeline_stages import layer_costs, stage_io, stage_module
from loom.plan.speed import predict_step_time

V_REFUSED = "needs torch 2.13 or newer" if v_schedules_send_to_own_rank() else ""
"""Where torch's V schedules cannot run over gloo, validation refuses them first."""


def test_balanced_split_minimises_the_costliest_stage() -> None:
    assert balanced_split([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert balanced_split([4, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 5)]
    assert balanced_split([1, 1, 1], 3) == [range(0, 1), range(1, 2), range(2, 3)]


def test_stage_indices_loop_or_fold_back() -> None:
    assert stage_indices(0, 2, 2, "interleaved-1f1b") == [0, 2]
    assert stage_indices(1, 2, 2, "interleaved-1f1b") == [1, 3]
    assert stage_indices(0, 2, 2, "dualpipev") == [0, 3]
    assert stage_indices(1, 4, 1, "1f1b") == [1]


def test_default_microbatches_keep_the_bubble_at_most_a_quarter() -> None:
    p = ParallelConfig(pp=2, pp_schedule="1f1b")
    assert choose_microbatches(p, 8) == 4 and bubble_fraction(2, 1, 4) == 0.2
    assert choose_microbatches(p, 2) == 2  # too small a batch: as many as divide it
    assert choose_microbatches(ParallelConfig(pp=2, pp_microbatches=8), 16) == 8


def test_stages_hold_their_layers_and_keep_the_model_names() -> None:
    with torch.device("meta"):
        model = Transformer(ModelArgs(dim=32, n_layers=4, n_heads=2, n_kv_heads=1,
                                      vocab_size=512, multiple_of=32))
    costs = layer_costs(model)
    assert len(costs) == 6 and costs[-1] > costs[0] > 0  # the head also multiplies
    first, last = (stage_module(model, r) for r in balanced_split(costs, 2))
    assert first.norm is None and last.tok_embeddings is None
    names = {n for stage in (first, last) for n, _ in stage.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}


@pytest.mark.parametrize(("flags", "message"), [
    ({"pp": 2, "pp_schedule": "gpipe", "pp_stages_per_rank": 2}, "one stage per rank"),
    ({"pp": 2, "pp_schedule": "dualpipev", "pp_stages_per_rank": 3},
     V_REFUSED or "two stages per rank"),
    ({"pp": 2, "pp_schedule": "dualpipev", "batch_size": 2},
     V_REFUSED or "no micro-batch count divides"),
    ({"pp": 2, "pp_schedule": "dualpipev", "batch_size": 8, "pp_microbatches": 2},
     V_REFUSED or "at least 4 micro-batches"),
    ({"model": "moe-debug", "pp": 2, "ep": 2, "pp_schedule": "zero-bubble"},
     V_REFUSED or "split backward gets the weight gradients of nested FSDP2 units"),
    ({"pp": 2, "pp_microbatches": 3, "batch_size": 4}, "must divide --batch-size"),
    ({"pp": 4, "pp_schedule": "interleaved-1f1b", "n_layers": 4}, "exceeds the 6 layers"),
])
def test_unworkable_pipelines_fail_at_validation(flags: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_flags({"model": "debug", **flags}, environ={})


def test_v_schedules_fill_the_bubble_given_two_micro_batches_per_stage() -> None:
    """ZB-V and DualPipeV idle (p-1)(F + B - 2W) and (p-1)(F&B + B - 3W): none when F, B and
    W take equal time, once 2 pp micro-batches fill the warm-up; with fewer, the looped
    1F1B's bubble over two stages per rank. `loom plan` stretches a step by it."""
    for schedule in ("zero-bubble", "dualpipev"):
        assert bubble_fraction(4, 2, 8, schedule) == 0.0
        assert bubble_fraction(4, 2, 4, schedule) == bubble_fraction(4, 2, 4) == 3 / 11
    assert choose_microbatches(ParallelConfig(pp=2, pp_schedule="zero-bubble"), 8) == 2
    assert choose_microbatches(ParallelConfig(pp=2, pp_schedule="dualpipev"), 8) == 4
    assert bubble_fraction(4, 2, 8, "interleaved-1f1b") == 3 / 19


def test_v_schedules_make_each_stage_one_fsdp2_unit() -> None:
    """torch's split backward is exact only for a stage that is one FSDP2 unit."""
    assert one_unit(ParallelConfig(pp=2, pp_schedule="zero-bubble"))
    assert one_unit(ParallelConfig(pp=2, pp_schedule="dualpipev"))
    assert not one_unit(ParallelConfig(pp=2, pp_schedule="1f1b"))
    assert not one_unit(ParallelConfig(pp=1, pp_schedule="zero-bubble"))


def test_stage_io_under_context_parallel_is_the_cp_shard_of_each_sequence() -> None:
    """The trainer shards each batch over cp before the schedule, so every stage's meta
    input and output (torch checks the received shapes against them) is seq_len / cp long,
    and between stages also split over tp."""
    cfg = config_from_flags({"model": "debug", "pp": 2, "cp": 2, "seq_len": 64,
                             "dtype": "fp32"}, environ={})
    with torch.device("meta"):
        model = Transformer(ModelArgs(dim=32, n_layers=4, n_heads=2, n_kv_heads=1,
                                      vocab_size=512, multiple_of=32))
    first, last = (stage_module(model, r) for r in balanced_split(layer_costs(model), 2))
    tokens, act = stage_io(first, cfg, 1, 2, hidden=False)
    assert tokens.shape == (2, 32) and act.shape == (2, 32, cfg.model.dim)
    hidden, logits = stage_io(last, cfg, 2, 2, hidden=False)
    assert hidden.shape == (2, 16, cfg.model.dim)
    assert logits.shape == (2, 32, cfg.model.vocab_size)


@pytest.mark.parametrize("schedule", ["zero-bubble", "dualpipev"])
def test_plan_step_time_of_v_schedules_has_no_bubble_given_two_micro_batches_per_stage(
        schedule: str, tmp_path: Path) -> None:
    """`loom plan` stretches the step by `bubble_fraction`: nothing once 2 pp micro-batches
    run; with fewer (zero-bubble only: dualpipev refuses them) by the looped 1F1B's
    1 / (1 - 1/5)."""
    if V_REFUSED:  # torch 2.11-2.12: refused at validation (loom.config.compose)
        with pytest.raises(ConfigError, match=V_REFUSED):
            config_from_flags({"pp": 2, "pp_schedule": schedule}, environ={})
        return

    def compute(microbatches: int, name: str) -> float:
        cfg = config_from_flags({"model": "debug", "pp": 2, "pp_schedule": name,
                                 "batch_size": 8, "pp_microbatches": microbatches,
                                 "dtype": "bf16"}, environ={})
        return predict_step_time(cfg, 2, "H100", tmp_path).compute_s

    filled = compute(4, schedule)
    assert compute(8, schedule) == pytest.approx(filled)  # nothing left to fill
    assert compute(2, "zero-bubble") == pytest.approx(filled * 1.25)
