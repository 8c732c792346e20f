"""A one-process training step issues no collective (issue #54, item 3): the step's valid
tokens, its loss and the MoE expert-bias counts are summed over groups of one rank, which
are already their own sums. Every torch.distributed collective is counted while each step
runs; on an accelerator each would be a launch and, over NCCL, a stream wait."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loom.runtime.distributed import RankInfo, summed
from loom.trainer.parity import layout_training

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "broadcast", "all_to_all_single", "all_gather_object", "barrier")


def counted_collectives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                        flags: list[str]) -> Counter:
    """Collectives issued inside `train_step` over a 3-step one-process run."""
    info = RankInfo(rank=0, world_size=1, local_rank=0, master_addr="localhost", master_port=0)
    calls: Counter = Counter()
    inside = [False]

    def counting(name: str, original):
        def call(*args, **kwargs):
            if inside[0]:
                calls[name] += 1
            return original(*args, **kwargs)
        return call

    for name in COLLECTIVES:
        monkeypatch.setattr(dist, name, counting(name, getattr(dist, name)))
    with layout_training(["--dataset", "random", "--vocab-size", "256", "--seq-len", "32",
                          "--batch-size", "2", "--max-steps", "3", "--log-every", "2",
                          "--outdir", str(tmp_path / "run"), *flags], info,
                         torch.device("cpu")) as trainer:
        step = trainer.train_step

        def watched(micro):
            inside[0] = True
            try:
                return step(micro)
            finally:
                inside[0] = False

        monkeypatch.setattr(trainer, "train_step", watched)
        trainer.fit()
    return calls


@pytest.mark.parametrize("flags", [["--model", "debug", "--fp32"],
                                   ["--model", "moe-debug", "--fp32", "--grad-accum-steps", "2"]],
                         ids=["llama", "moe-accumulated"])
def test_a_one_process_step_issues_no_collective(tmp_path, monkeypatch, process_group, flags):
    calls = counted_collectives(tmp_path, monkeypatch, flags)
    assert not calls, dict(calls)


def test_the_counter_sees_an_all_reduce(tmp_path, monkeypatch, process_group):
    """The counter is live: the same run with the reduction forced counts it every step."""
    import loom.trainer.trainer as trainer_module

    def forced(tensor, group=None):
        dist.all_reduce(tensor, group=group)
        return tensor

    monkeypatch.setattr(trainer_module, "summed", forced)
    calls = counted_collectives(tmp_path, monkeypatch, ["--model", "debug", "--fp32"])
    assert calls["all_reduce"] == 3, dict(calls)


def test_summed_reduces_over_a_group_of_more_than_one(monkeypatch, process_group):
    """A group of two ranks is reduced (the size is what decides, not the layout)."""
    seen = []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: seen.append(group))
    t = torch.ones(())
    assert summed(t, "g") is t and seen == ["g"]
