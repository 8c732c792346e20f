"""Real local `loom launch` jobs: small Python programs on 2 ranks under torch's elastic agent."""

import os
import subprocess
import sys
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
