"""Weighted mixtures: the schedule holds the ratios exactly over every cycle of windows,
each source is read whole in a seeded order per pass, the three exhaustion policies, the
window counts a checkpoint records, and a resume at another dp degree continuing the
identical window sequence (compared by (source, window) ids)."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest
import torch
from torch.utils.data import Dataset

from loom.config import ConfigError
from loom.data.loaders import build_dataloader
from loom.data.mixture import Mixture, check_mixture_state, mixture_state, parse_mixture

W = [Fraction(1, 2), Fraction(3, 10), Fraction(1, 5)]


class Ids(Dataset):
    """Source s's window i is the pair (s, i), so a batch says exactly what it holds."""

    def __init__(self, s: int, n: int):
        self.s, self.n = s, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"input": torch.tensor([self.s, i]), "labels": torch.tensor([self.s, i])}


def mixture(sizes: list[int], policy: str = "restart", weights=W, seed: int = 0) -> Mixture:
    return Mixture([f"s{i}" for i in range(len(sizes))],
                   [Ids(i, n) for i, n in enumerate(sizes)], list(weights), policy, seed)


def ids_by_step(mix: Mixture, batch: int, dp: int, steps: int,
                first_step: int = 0) -> list[list[tuple[int, int]]]:
    """Each step's global batch of (source, window) ids from step `first_step` on, the dp
    ranks' slices in rank order, epoch after epoch as the trainer draws them (a resumed
    run starts its epoch at the step it had reached)."""
    per_rank = []
    for rank in range(dp):
        loader = build_dataloader(mix, batch_size=batch, dp_rank=rank, dp_size=dp, seed=0,
                                  num_workers=0)
        epoch, skip = divmod(first_step, loader.sampler.steps_per_epoch)
        drawn: list[list[tuple[int, int]]] = []
        while len(drawn) < steps:
            loader.sampler.set_epoch(epoch, start_step=skip)
            drawn += [[tuple(r) for r in b["input"].tolist()] for b in loader]
            epoch, skip = epoch + 1, 0
        per_rank.append(drawn[:steps])
    return [sum((per_rank[r][k] for r in range(dp)), []) for k in range(steps)]


@pytest.mark.parametrize(("spec", "parsed"), [
    ("a.txt:0.7,b/:0.3", [("a.txt", Fraction(7, 10)), ("b/", Fraction(3, 10))]),
    ("x:2,y:1,z:1", [("x", Fraction(1, 2)), ("y", Fraction(1, 4)), ("z", Fraction(1, 4))]),
    ("x:1/3,y:.5", [("x", Fraction(2, 5)), ("y", Fraction(3, 5))]),
    ("corpus.txt", None), ("owner/name", None), ("a,b.txt", None), (None, None)])
def test_a_mixture_is_two_or_more_weighted_sources(spec, parsed):
    assert parse_mixture(spec) == parsed


@pytest.mark.parametrize(("spec", "message"), [
    ("a:0.5,b:x", "is not a number"), ("a:0.5,b:0", "must be > 0"),
    ("a:1,a:2", "named twice"), ("a:0.12347,b:0.1", "common denominator"),
    (",".join(f"s{i}:1" for i in range(17)), "at most 16"), ("a:1/0,b:1", "not a number"),
    ("a:nan,b:1", "not a number"), ("a:1e999999999,b:1", "not a number")])
def test_bad_mixtures_are_one_line(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_mixture(spec)


def test_every_ten_windows_hold_the_ratios_exactly_and_100_steps_do_too():
    mix = mixture([1000, 700, 300])
    steps = ids_by_step(mix, batch=3, dp=2, steps=100)
    sources = [s for step in steps for s, _ in step]
    for start in range(0, len(sources), 10):
        assert Counter(sources[start:start + 10]) == {0: 5, 1: 3, 2: 2}
    assert Counter(sources) == {0: 300, 1: 180, 2: 120}
    assert mix.windows_taken(600) == {"s0": 300, "s1": 180, "s2": 120}


def test_restart_reads_each_source_whole_in_a_new_seeded_order_each_pass():
    mix = mixture([20, 3, 2])  # s0 lasts 40 windows; s1 and s2 are read 4 times each
    epoch = [mix.source_window(p) for p in range(len(mix))]
    assert len(mix) == 40 and mix.windows_taken(40) == {"s0": 20, "s1": 12, "s2": 8}
    assert sorted(i for s, i in epoch if s == 0) == list(range(20))
    reads = [i for s, i in epoch if s == 1]
    passes = [tuple(reads[k:k + 3]) for k in range(0, 12, 3)]
    assert all(sorted(p) == [0, 1, 2] for p in passes)
    assert len(set(passes)) > 1, "each pass in its own order"
    second = [mix.source_window(p) for p in range(40, 80)]
    assert [s for s, _ in second] == [s for s, _ in epoch], "the same schedule each epoch"
    assert second != epoch, "each epoch reads its sources in a new order"
    assert [mixture([20, 3, 2], seed=0).source_window(p) for p in range(40)] == epoch
    assert [mixture([20, 3, 2], seed=1).source_window(p) for p in range(40)] != epoch


def test_stop_ends_the_epoch_when_the_first_source_runs_out():
    mix = mixture([100, 100, 4], "stop")
    counts = mix.windows_taken(len(mix))
    assert counts["s2"] == 4 and len(mix) == sum(counts.values())
    sources = [mix.source_window(p)[0] for p in range(len(mix))]
    assert sources.count(2) == 4 and sources[-1] == 2, "it ends with s2's last window"
    assert 15 < len(mix) <= 20  # s2 takes 1 window in 5


def test_drop_reads_every_window_once_and_shares_the_rest_by_weight():
    mix = mixture([10, 9, 2], "drop")
    windows = [mix.source_window(p) for p in range(len(mix))]
    assert len(mix) == 21 and sorted(windows) == sorted(
        (s, i) for s, n in enumerate([10, 9, 2]) for i in range(n))
    first = [s for s, _ in windows[:10]]
    assert Counter(first) == {0: 5, 1: 3, 2: 2}  # s2 is out after its 2 windows
    after = [s for s, _ in windows[10:15]]
    assert Counter(after) == {0: 3, 1: 2}  # 0.5 : 0.3 of what remains


def test_a_resume_at_another_dp_degree_continues_the_identical_window_sequence():
    mix = mixture([40, 30, 9])  # s2 restarts inside an epoch of 99 windows (24 steps)
    assert len(mix) // 4 == 24
    whole = ids_by_step(mix, batch=4, dp=1, steps=50)  # 1 rank, global batch 4
    begun = ids_by_step(mix, batch=4, dp=1, steps=7)
    resumed = ids_by_step(mix, batch=2, dp=2, steps=20, first_step=7)  # 2 ranks, same G
    again = ids_by_step(mix, batch=1, dp=4, steps=23, first_step=27)  # 4 ranks, epoch 1 on
    assert begun + resumed + again == whole
    state = mixture_state(mix, 50 * 4)["mixture"]
    assert [s["windows"] for s in state["sources"]] == [
        sum(1 for step in whole for s, _ in step if s == k) for k in range(3)]


def test_a_resume_must_be_the_checkpoints_mixture():
    saved = mixture_state(mixture([40, 30, 9]), 100)
    check_mixture_state(mixture([40, 30, 9]), saved, 100)
    for other in (mixture([40, 30, 9], "drop"), mixture([40, 30, 9], weights=W[::-1])):
        with pytest.raises(ConfigError, match="differs from the checkpoint"):
            check_mixture_state(other, saved, 100)
