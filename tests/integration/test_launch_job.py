"""Real local `loom launch` jobs: small Python programs on 2 ranks under torch's elastic agent."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import loom

LAUNCH = "import sys; from loom.runtime.launch import main; sys.exit(main(sys.argv[1:]))"


def run_launch(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_ID", "PBS_JOBID")}
    src = str(Path(loom.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", LAUNCH, *argv], env=env, capture_output=True,
                          text=True, timeout=timeout)


def rank_program(body: str) -> list[str]:
    return [sys.executable, "-c", f"import os, sys, time\nrank = int(os.environ['RANK'])\n{body}"]


@pytest.mark.multirank
def test_all_ranks_succeed_and_only_rank0_stdout_is_shown():
    body = "print(f'out from rank {rank}')\nprint(f'note from rank {rank}', file=sys.stderr)"
    result = run_launch("-n", "2", *rank_program(body))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["out from rank 0"]
    assert "note from rank 0" in result.stderr and "note from rank 1" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.multirank
def test_failing_rank_ends_the_job_with_its_error_shown():
    body = (
        "if rank == 1:\n"
        "    print('error: rank 1 is broken', file=sys.stderr)\n"
        "    sys.exit(3)\n"
        "time.sleep(3600)"
    )
    result = run_launch("-n", "2", *rank_program(body))  # a kept rank 0 would time out
    assert result.returncode == 3
    assert "error: rank 1 is broken" in result.stderr
    assert "loom launch: rank 1 (local 1) failed with exit code 3" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.multirank
def test_a_rank_that_exits_0_early_ends_the_job_with_one_line():
    """Rank 1 leaves at once with exit 0; rank 0 would wait for it in a collective until
    --comm-timeout-s (here: sleeps an hour). The job ends after the grace with one line."""
    from loom.runtime.launch_commands import EARLY_EXIT_GRACE_S

    body = "if rank == 1:\n    sys.exit(0)\ntime.sleep(3600)"
    started = time.monotonic()
    result = run_launch("-n", "2", *rank_program(body), timeout=120)
    assert time.monotonic() - started < EARLY_EXIT_GRACE_S + 20, result.stderr
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("loom launch:")]
    assert lines == [f"loom launch: rank 1 (local 1, host {socket.gethostname()}) exited 0 "
                     f"while 1 rank(s) still ran; ended the job after "
                     f"{EARLY_EXIT_GRACE_S:g} s"], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.multirank
def test_ranks_that_finish_a_few_seconds_apart_succeed():
    """A finished job's ranks may leave a moment apart (rank 0 writes its summary last)."""
    result = run_launch("-n", "2", *rank_program("time.sleep(3 if rank == 0 else 0)"))
    assert result.returncode == 0, result.stderr
    assert "loom launch" not in result.stderr
