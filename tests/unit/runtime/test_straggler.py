"""Straggler detection on synthetic numbers: own step times from arrival offsets, the
lagging test against the other ranks' median, and a watch that names a rank once, only
after it lagged in 3 of the last 4 logging intervals."""

from __future__ import annotations

import logging

import pytest

from loom.runtime.straggler import StragglerWatch, arrivals, lagging, own_step_times, spread


def test_arrivals_count_only_the_window() -> None:
    assert arrivals([5, 10, 20, 30, 40], since_ns=10, until_ns=30) == (
        pytest.approx(30e-9), pytest.approx(10e-9), 2)


def test_own_step_times_remove_the_wait_for_the_last_arriver() -> None:
    # 4 collectives in a 1 s step; rank 1 arrives 0.3 s later summed over them: rank 0
    # waited 0.3 s. Offsets to the end: 4 x 1 s - the offsets from the start.
    assert own_step_times(1.0, [0.2, 0.5], [3.8, 3.5], [4, 4], [0.0, 0.0]) == pytest.approx(
        [0.7, 1.0])
    assert own_step_times(1.0, [0.2, 0.5], [3.8, 3.5], [4, 3], [0.0, 0.0]) is None, "differ"


def test_time_blocked_in_loom_exchanges_counts_as_wait() -> None:
    assert own_step_times(1.0, [0.0, 0.0], [0.0, 0.0], [0, 0], [0.6, 0.1]) == pytest.approx(
        [0.4, 0.9])


def test_a_late_origin_on_the_slow_rank_does_not_invert_the_answer() -> None:
    # as above, but rank 1 read its start 0.2 s late: its 4 offsets from the start shrink
    # by 0.8 s, so that sum alone says rank 1 waited; the sums to the end do not move
    assert own_step_times(1.0, [0.2, -0.3], [3.8, 3.5], [4, 4], [0.0, 0.0]) == pytest.approx(
        [0.7, 1.0])


def test_spread_names_the_slowest_rank() -> None:
    assert spread([0.1, 0.4, 0.2]) == {"train/rank_dt_min": 0.1, "train/rank_dt_median": 0.2,
                                       "train/rank_dt_max": 0.4, "train/slowest_rank": 1}


@pytest.mark.parametrize(("times", "slow"), [
    ([1.0, 1.0, 1.0, 1.0], []),
    ([1.0, 1.29, 1.0, 1.0], []),
    ([1.0, 1.3, 1.0, 1.0], [1]),
    ([1.0, 2.0], [1]),  # two ranks: judged against the other one, not a median with itself
    ([3.0, 1.0, 3.0, 1.0], [0, 2]),
    ([5.0], []),
])
def test_lagging_is_relative_to_the_other_ranks_median(times: list[float], slow: list[int]
                                                       ) -> None:
    assert lagging(times) == slow


def test_a_rank_is_named_once_after_lagging_in_patience_of_the_last_intervals(caplog
                                                                             ) -> None:
    watch = StragglerWatch(["a", "b", "c"], patience=3)
    even, slow = [1.0, 1.0, 1.0], [1.0, 1.0, 2.0]
    with caplog.at_level(logging.WARNING, logger="loom"):
        named = [watch.observe(step, t) for step, t in
                 enumerate([slow, even, even, slow, slow, even, slow, slow], start=1)]
    assert named == [[], [], [], [], [], [], [2], []], "3 of the last 4, then never again"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "rank 2 (c)" in lines[0] and "2.00x" in lines[0], lines
    assert watch.summary() == [{"rank": 2, "host": "c", "step": 7, "max_ratio": 2.0}]


def test_an_even_job_with_noise_names_nobody() -> None:
    watch = StragglerWatch(["a", "b"], patience=3)
    noisy = [[1.0, 1.2], [1.25, 1.0], [1.0, 1.4], [1.0, 1.1], [1.0, 1.5], [1.2, 1.0],
             [1.4, 1.0], [1.0, 1.3], [1.0, 1.0], [1.6, 1.0]]  # 2 of 4 at most, either rank
    assert not any(watch.observe(step, t) for step, t in enumerate(noisy, start=1))
    assert watch.summary() == []
