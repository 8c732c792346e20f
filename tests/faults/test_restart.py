"""Runs that survive a dying rank: under `loom launch --max-restarts N`, torch's agent starts
the ranks again and each restart continues the run from its newest complete checkpoint
without any flag added. A rank SIGKILLed at random moments, a job that still ends with the
same weights, optimizer state and RNG, to the bit, as one never interrupted."""

from __future__ import annotations

import contextlib
import os
import random
import signal
from pathlib import Path

import pytest

from tests.faults.procs import LOOM, TINY, children, digest, finish, start, steps_logged, wait_for


def attempt_of(pid: int) -> int | None:
    """The restart count torch's agent gave a rank (None once it is gone)."""
    with contextlib.suppress(OSError, StopIteration, ValueError):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        return int(next(v for v in env if v.startswith(b"TORCHELASTIC_RESTART_COUNT="))
                   .split(b"=")[1])
    return None


def ranks_of_attempt(launcher: int, attempt: int) -> list[int]:
    return [pid for pid in children(launcher) if attempt_of(pid) == attempt]


def job(outdir: Path, steps: int, interval: int, restarts: int):
    return start([*LOOM, "launch", "-n", "2", "--max-restarts", str(restarts), *LOOM, "train",
                  *TINY, "--max-steps", str(steps), "--checkpoint-interval", str(interval),
                  "--outdir", str(outdir)])


def final_state(outdir: Path, steps: int) -> dict[str, str]:
    """The last checkpoint's tensor files (weights, AdamW state) and RNG states by sha256;
    loop.json differs by design (run id, times)."""
    files = digest(outdir / "checkpoints" / f"step-{steps}")
    return {name: h for name, h in files.items() if name.endswith(".distcp")
            or name.startswith("rng")}


def chaos(tmp_path: Path, steps: int, interval: int, kills: int, seed: int) -> None:
    """`kills` SIGKILLs of a random rank, each once the job has logged a random number of
    rows, then the job must finish by itself and match an uninterrupted run."""
    rng = random.Random(seed)
    moments = sorted(rng.sample(range(3, steps - 2), kills))
    proc = job(tmp_path / "chaos", steps, interval, kills)
    for attempt, moment in enumerate(moments):
        wait_for(lambda a=attempt, m=moment: steps_logged(tmp_path / "chaos") >= m
                 and len(ranks_of_attempt(proc.pid, a)) == 2, f"row {moment}", 300, proc)
        victim = rng.choice(ranks_of_attempt(proc.pid, attempt))
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda a=attempt: len(ranks_of_attempt(proc.pid, a + 1)) == 2,
                 f"restart {attempt + 1}", 300, proc)
    code, out, err = finish(proc, 600)
    assert code == 0, err[-3000:]
    for attempt in range(1, kills + 1):  # rank 0's log (stdout) names each restart
        assert f"restart {attempt} of this job: continuing from the newest complete " \
               "checkpoint" in out, f"restart {attempt} not named\n{out[-3000:]}"

    code, _, err = finish(job(tmp_path / "straight", steps, interval, 0), 600)
    assert code == 0, err[-3000:]
    chaotic, straight = final_state(tmp_path / "chaos", steps), \
        final_state(tmp_path / "straight", steps)
    assert chaotic and chaotic == straight


@pytest.mark.multirank
def test_a_rank_killed_twice_restarts_and_ends_bit_identical(tmp_path: Path) -> None:
    chaos(tmp_path, steps=20, interval=5, kills=2, seed=1)


@pytest.mark.multirank
@pytest.mark.slow
def test_a_rank_killed_three_times_in_60_steps_ends_bit_identical(tmp_path: Path) -> None:
    chaos(tmp_path, steps=60, interval=10, kills=3, seed=2)
