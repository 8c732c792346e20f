"""Two `loom launch` processes, one per "node", joined by c10d rendezvous on 127.0.0.1: the
multi-node path (each node's elastic agent, the rendezvous, global ranks across agents)
run for real on one machine. Its losses must equal a one-launcher `-n 2` job's exactly:
the same two ranks, seed and collectives, only started differently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import loom
from tests.compare import column
from tests.harness import free_port

LAUNCH = "import sys; from loom.launch import main; sys.exit(main(sys.argv[1:]))"
TRAIN = [sys.executable, "-m", "loom", "train", "--model", "debug", "--dataset", "random",
         "--vocab-size", "512", "--seq-len", "64", "--fp32", "--batch-size", "2",
         "--max-steps", "4", "--seed", "3"]


def launcher(*argv: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_ID", "PBS_JOBID")}
    src = str(Path(loom.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen([sys.executable, "-c", LAUNCH, *argv], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(procs: list[subprocess.Popen], timeout: float = 600) -> list[tuple[int, str]]:
    """Wait for every launcher (killing all if one outlives `timeout`): (exit code, stderr)."""
    results = []
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=timeout)
            results.append((proc.returncode, err))
    finally:
        for proc in procs:
            proc.kill()
    return results


@pytest.mark.multirank
def test_two_launchers_train_as_one_two_rank_job(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [launcher("--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", endpoint,
                      "--rdzv-id", "multinode-test", "-n", "1", *TRAIN,
                      "--outdir", str(tmp_path / "two-nodes"))
             for rank in (0, 1)]
    for code, err in finish(nodes):
        assert code == 0, err[-3000:]
    (code, err), = finish([launcher("-n", "2", *TRAIN, "--outdir", str(tmp_path / "one-node"))])
    assert code == 0, err[-3000:]

    two, one = column(tmp_path / "two-nodes"), column(tmp_path / "one-node")
    assert sorted(two) == [1, 2, 3, 4]
    assert two == one, f"two launchers {two} vs one launcher {one}"
    config = json.loads((tmp_path / "two-nodes" / "config.json").read_text())
    assert config["world_size"] == 2 and config["mesh"]["dp_shard"] == 2, config["mesh"]
