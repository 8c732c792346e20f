"""A training step that is not a logging step reads nothing from the device: every path by
which torch hands a tensor's value to the host is counted while a short run trains, and the
steps between logging steps must count zero (issue #33, item 1). On the CPU the reads would
cost nothing; on an accelerator each one drains the queue and idles the device."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

import loom.observability.metrics.recorder
import loom.trainer.trainer
from loom.losses import MODES
from loom.models.moe import model as moe_model
from loom.runtime.distributed import RankInfo
from loom.trainer.optim import clip_grad_norm as clip
from loom.trainer.parity import layout_training
from loom.trainer.step import ahead_on_device
from loom.trainer.trainer import Trainer

READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
         "nonzero", "argwhere")
"""The tensor methods that copy a value to the host (and so wait for the device); `nonzero`
and `argwhere` wait for the count of what they find, which sizes their output."""
SYNCING_FUNCTIONS = ("nonzero", "argwhere", "masked_select", "unique")
"""torch functions of a data-dependent output size: each waits for the device."""


def counted_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str],
                model: tuple[str, ...] = ("--model", "debug", "--fp32"),
                ) -> tuple[dict[int, Counter], Trainer]:
    """Host reads by the step that was running (from its train_step to the next's)."""
    info = RankInfo(rank=0, world_size=1, local_rank=0, master_addr="localhost", master_port=0)
    with layout_training([*model, "--dataset", "random", "--vocab-size", "256",
                          "--seq-len", "32", "--batch-size", "2",
                          "--outdir", str(tmp_path / "run"), *flags], info,
                         torch.device("cpu")) as trainer:
        return counted_steps(trainer, monkeypatch), trainer


def counted_steps(trainer: Trainer, monkeypatch: pytest.MonkeyPatch) -> dict[int, Counter]:
    """Train `trainer` to the end, counting host reads by the step that was running."""
    reads: dict[int, Counter] = {}
    current, loading = [0], [False]

    def counting(name: str, original):
        def read(self, *args, **kwargs):
            if not loading[0]:
                reads.setdefault(current[0], Counter())[name] += 1
            return original(self, *args, **kwargs)
        return read

    draw = loom.trainer.trainer.steps_until

    def loader_steps(t, total):
        """The loader's own reads are of host tensors (the sampler's index order) on
        every device, never of the device's: not counted."""
        steps = draw(t, total)
        while True:
            loading[0] = True
            try:
                item = next(steps)
            except StopIteration:
                return
            finally:
                loading[0] = False
            yield item

    monkeypatch.setattr(loom.trainer.trainer, "steps_until", loader_steps)

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    for name in SYNCING_FUNCTIONS:
        original = getattr(torch, name)
        monkeypatch.setattr(torch, name, counting(f"torch.{name}", original))
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda *a: reads.setdefault(current[0], Counter()).update(["sync"]))
    step = trainer.train_step

    def numbered_step(micro):
        current[0] = trainer.loop.step + 1
        return step(micro)

    monkeypatch.setattr(trainer, "train_step", numbered_step)
    trainer.fit()
    monkeypatch.undo()
    return reads


LOGGING = {1, 4, 8}
"""--log-every 4 over 8 steps: the first, every fourth and the last."""


def test_no_host_read_on_a_non_logging_step(tmp_path, monkeypatch, process_group):
    reads, _ = counted_run(tmp_path, monkeypatch, ["--max-steps", "8", "--log-every", "4"])
    quiet = {step: dict(reads.get(step, {})) for step in range(1, 9) if step not in LOGGING}
    assert all(not counts for counts in quiet.values()), quiet
    assert all(reads.get(step) for step in LOGGING), "the counter saw the logging steps' reads"


def test_no_host_read_on_a_non_logging_step_of_one_process_moe(tmp_path, monkeypatch,
                                                                process_group):
    """MoE in bf16 at one process (issue #54): grouped expert matmuls, and the expert-bias
    step hook masks itself with the device's `applied` flag and keeps its metrics on the
    device, so neither whether the step was finite nor the hook's metrics are read until
    the logging step; the rows still carry the MoE columns."""
    reads, _ = counted_run(tmp_path, monkeypatch, ["--max-steps", "8", "--log-every", "4"],
                           model=("--model", "moe-debug", "--dtype", "bf16"))
    quiet = {step: dict(reads.get(step, {})) for step in range(1, 9) if step not in LOGGING}
    assert all(not counts for counts in quiet.values()), quiet
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics-0.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(math.isfinite(r["moe/load_imbalance"]) for r in rows), rows[-1]


@pytest.mark.parametrize("loss_impl", MODES)
def test_no_host_read_on_a_non_logging_step_for_every_loss(tmp_path, monkeypatch,
                                                          process_group, loss_impl):
    """Every --loss-impl (loss-parallel falls back to compiled at tp 1): the fused and
    chunked losses' per-chunk work selects nothing by a data-dependent size."""
    reads, _ = counted_run(tmp_path, monkeypatch, ["--max-steps", "5", "--log-every", "4",
                                                   "--loss-impl", loss_impl,
                                                   "--loss-chunk-size", "16"])
    quiet = {step: dict(reads.get(step, {})) for step in (2, 3)}
    assert all(not counts for counts in quiet.values()), quiet


def test_the_counter_sees_a_nonzero(tmp_path, monkeypatch, process_group):
    """The counter catches a per-step `nonzero` (what fused-linear once did per chunk)."""
    monkeypatch.setattr(loom.trainer.trainer, "clip_grad_norm",
                        lambda params, *a, **k: (torch.ones(3).nonzero(), clip(params, *a, **k))[1])
    reads, _ = counted_run(tmp_path, monkeypatch, ["--max-steps", "3", "--log-every", "4"])
    assert reads.get(2, {}).get("nonzero") == 1, reads


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_skipped_steps_are_read_and_warned_at_the_logging_step(tmp_path, monkeypatch,
                                                               process_group, caplog,
                                                               optimizer):
    """lr 1e30 overflows from step 2 on: every later step is skipped on the device, and
    the host learns of each (in order, by its step number) only at the logging step (Muon
    too: its matrices' step masks itself with the same device flag as its fused AdamW)."""
    flags = ["--max-steps", "8", "--log-every", "4", "--lr", "1e30", "--warmup-steps", "0",
             "--skip-nonfinite", "--max-skipped-steps", "100", "--optimizer", optimizer]
    with caplog.at_level("WARNING", logger="loom"):
        reads, trainer = counted_run(tmp_path, monkeypatch, flags)
    quiet = {step: dict(reads.get(step, {})) for step in range(1, 9) if step not in LOGGING}
    assert all(not counts for counts in quiet.values()), quiet
    warned = [r.getMessage() for r in caplog.records if "update skipped" in r.getMessage()]
    assert warned == [f"step {s}: non-finite loss or gradient, update skipped"
                      for s in range(2, 9)]
    rows = [json.loads(line) for line in
            (tmp_path / "run" / "metrics-0.jsonl").read_text().splitlines()]
    assert [r["opt/iter"] for r in rows] == [1] * 8, "only step 1's update was applied"
    assert all(not math.isfinite(r["train/loss"] * r["grad/norm_preclip"]) for r in rows[1:])
    assert len({r["opt/lr"] for r in rows}) == 1, "a skipped step shows the applied one's lr"
    states = list(trainer.optimizer.state.values())
    assert states and all(float(s["step"]) == 1 for s in states), "one update counted"
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_data_reaches_the_device_one_step_ahead():
    """When step k is handed out, step k+1's micro-batches were already drawn and their
    copies queued ("meta" stands in for an accelerator)."""
    drawn: list[int] = []

    def steps():
        for k in range(3):
            drawn.append(k)
            yield 0, k, [{"input": torch.full((1, 4), k), "labels": torch.full((1, 4), k)}]

    handed = []
    for _, k, micro in ahead_on_device(steps(), torch.device("meta")):
        handed.append((k, list(drawn)))
        assert micro[0]["input"].device.type == "meta"
    assert handed == [(0, [0, 1]), (1, [0, 1, 2]), (2, [0, 1, 2])]


def test_a_rarely_logging_run_is_read_every_max_queued_steps(tmp_path, monkeypatch,
                                                           process_group):
    monkeypatch.setattr(loom.trainer.trainer, "MAX_QUEUED", 3)
    monkeypatch.setattr(loom.observability.metrics.recorder, "MAX_QUEUED", 3)
    reads, _ = counted_run(tmp_path, monkeypatch, ["--max-steps", "8", "--log-every", "100"])
    assert {step for step in range(1, 9) if reads.get(step)} == {1, 4, 7, 8}, reads
    rows = (tmp_path / "run" / "metrics-0.jsonl").read_text().splitlines()
    assert len(rows) == 8


def test_one_process_bf16_moe_forward_backward_reads_nothing(tmp_path, monkeypatch,
                                                             process_group):
    """MoE under bf16 autocast over fp32 weights (issue #54): every expert product is
    torch's grouped matmul, so the steps' forward and backward read nothing to the host
    (the loop's `counts.tolist()` was once per layer, forward and backward). What the step
    reads besides, with a step hook (the expert-bias update's decision and its metrics),
    is the trainer's, outside the model: not counted here."""
    grouped, looped, reads = Counter(), Counter(), Counter()
    monkeypatch.setattr(torch, "_grouped_mm", counting_call(grouped, torch._grouped_mm))
    monkeypatch.setattr(moe_model, "looped_expert_mm",
                        counting_call(looped, moe_model.looped_expert_mm))
    info = RankInfo(rank=0, world_size=1, local_rank=0, master_addr="localhost", master_port=0)
    with layout_training(["--model", "moe-debug", "--dataset", "random", "--vocab-size", "256",
                          "--seq-len", "32", "--batch-size", "2", "--dtype", "bf16",
                          "--max-steps", "3", "--log-every", "4", "--outdir",
                          str(tmp_path / "run")], info, torch.device("cpu")) as trainer:
        batch = next(iter(trainer.loader))  # the sampler's host reads: not the step's
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name,
                                counting_call(reads, getattr(torch.Tensor, name), name))
        for name in SYNCING_FUNCTIONS:
            monkeypatch.setattr(torch, name, counting_call(reads, getattr(torch, name), name))
        done = trainer.executor.forward_backward([batch], lambda: None)
        monkeypatch.undo()
    assert done.loss_sum.isfinite()
    assert not reads, dict(reads)
    assert grouped["calls"] and not looped["calls"], (grouped, looped)


def counting_call(counter: Counter, original, name: str = "calls"):
    def call(*args, **kwargs):
        counter[name] += 1
        return original(*args, **kwargs)
    return call
