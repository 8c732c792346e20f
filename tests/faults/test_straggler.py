"""A rank that is slow but alive is named: rank 1 of a 2-rank job slowed in every step (by a
sleep that holds on a loaded machine, or stopped and continued on a duty cycle, running a
fifth of the time) is named as a straggler, once, within five logging intervals, and
listed in summary.json, and rank 0 never is; an evenly loaded job names nobody."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.faults.procs import (
    LOOM,
    TINY,
    alive,
    children,
    finish,
    launch,
    rank_of,
    start,
    steps_logged,
    wait_for,
)

STEPS = ("--max-steps", "14")
WARNING = re.compile(r"straggler: rank (\d+) \(([^)]*)\)")


def duty_cycle(pid: int, stop: threading.Event, run_s: float = 0.006, stopped_s: float = 0.024
               ) -> None:
    """SIGSTOP/SIGCONT `pid` until `stop` is set: it runs `run_s` of every cycle."""
    with contextlib.suppress(ProcessLookupError):  # the rank ended between two signals
        while not stop.is_set() and alive(pid):
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(run_s)


def usable_cpus() -> set[int]:
    """The CPUs this process (and the ranks it starts) may run on: fewer than the machine's
    under `taskset`."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def skip_if_oversubscribed(per_core: float) -> None:
    """Skip when the machine runs more than `per_core` runnable processes per core: the
    ranks then get uneven, shifting shares of the CPU (other jobs' processes slow one rank
    or the other), which is what these tests must control."""
    load, cores = os.getloadavg()[0], len(usable_cpus())
    if load > per_core * cores:
        pytest.skip(f"load {load:.1f} on {cores} cores: the ranks would not get even shares "
                    "of the CPU")


def summary(outdir: Path) -> dict:
    return json.loads((outdir / "summary.json").read_text())


def assert_only_rank_1_named(outdir: Path, out: str, err: str, slowed_from: int) -> None:
    named = WARNING.findall(out + err)  # rank 0's log goes where its progress does
    assert [rank for rank, _ in named] == ["1"], err[-3000:]
    found = summary(outdir)["stragglers"]
    assert [s["rank"] for s in found] == [1] and found[0]["host"] == named[0][1]
    assert found[0]["step"] <= slowed_from + 5, (found, slowed_from)
    assert found[0]["max_ratio"] >= 1.3


@pytest.mark.multirank
def test_a_rank_that_sleeps_in_every_step_is_named_within_five_intervals(tmp_path: Path
                                                                         ) -> None:
    """The default selection's straggler test, run whatever the load: rank 1 sleeps after
    each step's work twice as long as that work took, and at least 0.25 s (a third of its
    speed or less, see tests/workers/slow_rank_worker.py), from the first step on. The
    first step is not measured (no sync point before it), so the five intervals are those
    of steps 2-6; rank 0, which only waits for rank 1, is never named."""
    outdir = tmp_path / "run"
    proc = start([*LOOM, "launch", "-n", "2", sys.executable, "tests/workers/slow_rank_worker.py",
                  *TINY, "--outdir", str(outdir), *STEPS], TMPDIR=str(tmp_path),
                 SLOW_RANK="1", SLOW_FACTOR="2", SLOW_MIN_S="0.25")
    code, out, err = finish(proc, 300)
    assert code == 0, err[-3000:]
    assert_only_rank_1_named(outdir, out, err, slowed_from=1)


def duty_cycled_run(outdir: Path, tmp_path: Path) -> tuple[str, str, int]:
    """One 2-rank run whose rank 1 is duty-cycled from its third step on: (stdout, stderr,
    the first step slowed)."""
    proc = launch(2, outdir, *STEPS, TMPDIR=str(tmp_path))
    wait_for(lambda: steps_logged(outdir, 0) >= 2, "second step", 240, proc)
    victim = next(pid for pid in children(proc.pid) if rank_of(pid) == 1)
    slowed_from = steps_logged(outdir, 0) + 1
    stop = threading.Event()
    slower = threading.Thread(target=duty_cycle, args=(victim, stop), daemon=True)
    slower.start()
    try:
        code, out, err = finish(proc, 300)
    finally:
        stop.set()
        slower.join()
        if alive(victim):
            os.kill(victim, signal.SIGCONT)
    assert code == 0, err[-3000:]
    return out, err, slowed_from


def own_time_ratios(outdir: Path) -> list[tuple[int, float]]:
    """(step, rank 1's own step time over rank 0's) for each measured row: the failure
    message shows which intervals lagged."""
    rows = [json.loads(line) for line in (outdir / "metrics-0.jsonl").read_text().splitlines()]
    return [(r["train/iter"], round(r["train/rank_dt_max"] / max(r["train/rank_dt_min"], 1e-9)
                                    * (1 if r["train/slowest_rank"] == 1 else -1), 2))
            for r in rows if "train/slowest_rank" in r]


@pytest.mark.multirank
def test_a_rank_slowed_on_a_duty_cycle_is_named_within_five_intervals(tmp_path: Path) -> None:
    """Rank 1 is stopped four fifths of the time from outside. Under a loaded suite the
    other processes also take rank 0's CPU at random (CI on 2 cores: rank 1 lagged 4.1x at
    its worst but in fewer than three of four intervals until step 10 of a run slowed from
    4): so up to three runs, each naming rank 1 alone, and one of them within five
    intervals. A detector that cannot name a rank running a fifth of the time misses in
    every run."""
    skip_if_oversubscribed(2)  # on 2 cores: 3 of 4 runs passed at load 4.5-6, 1 of 2 at 12
    late = []
    for attempt in range(3):
        outdir = tmp_path / f"run{attempt}"
        out, err, slowed_from = duty_cycled_run(outdir, tmp_path)
        named = WARNING.findall(out + err)  # rank 0's log goes where its progress does
        assert [rank for rank, _ in named] == ["1"], err[-3000:]
        found = summary(outdir)["stragglers"]
        assert [s["rank"] for s in found] == [1] and found[0]["host"] == named[0][1]
        assert found[0]["max_ratio"] >= 1.3
        # the first interval may be partly slowed: five whole ones follow it
        if found[0]["step"] <= slowed_from + 5:
            return
        late.append((found[0]["step"], slowed_from, own_time_ratios(outdir)))
    pytest.fail(f"named late in every run (step, slowed from, ratios; negative: rank 0 "
                f"slower): {late}")


@pytest.mark.multirank
def test_an_evenly_loaded_job_names_no_straggler(tmp_path: Path) -> None:
    """Only below a load of 1 per core, where each rank gets a core of its own. Sharing
    cores, a rank truly lags: scheduled by the kernel on a 2-core machine with other work,
    one rank got the smaller share for most of a run (its main thread ran as long as the
    other's, within ~6 ms of ~50 ms a step, but waited 80-160 ms a step more for a CPU;
    4 of 5 runs at load 3.4-5 named a rank). Pinning both ranks to one CPU helped (16 of
    16 runs at load 3.1-9.4 clean) but not always: a whole suite run under `taskset -c 1`
    named one, and so did one of 3 pinned runs at load 8-12."""
    if len(usable_cpus()) < 2:
        pytest.skip(f"{len(usable_cpus())} usable CPU: the two ranks would share it")
    skip_if_oversubscribed(1)
    # The load average trails by a minute: a suite's previous test can still hold a core
    # when this one starts (CI on 2 cores named a rank twice in 2026-12). A detector that
    # names an even job names it every time, so up to three runs must not all name one.
    for attempt in range(3):
        outdir = tmp_path / f"run{attempt}"
        proc = launch(2, outdir, *STEPS, TMPDIR=str(tmp_path))
        code, out, err = finish(proc, 300)
        assert code == 0, err[-3000:]
        if not WARNING.findall(out + err):
            break
    assert not WARNING.findall(out + err), out[-3000:]
    assert summary(outdir)["stragglers"] == []
    rows = [json.loads(line) for line in (outdir / "metrics-0.jsonl").read_text().splitlines()]
    measured = [r for r in rows if "train/slowest_rank" in r]
    assert [r["train/iter"] for r in measured] == list(range(2, 15)), "all but the first"
    assert all(r["train/rank_dt_min"] <= r["train/rank_dt_median"] <= r["train/rank_dt_max"]
               and r["train/slowest_rank"] in (0, 1) for r in measured)
