"""`loom launch --ft-replica-groups`: the lighthouse and every group end with the launcher,
a SIGKILLed one included, and a mistake is one line however many groups make it."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from loom.observability.metrics import read_rows
from loom.trainer.replica_groups import QUORUM_TIMEOUT_S
from tests.faults.procs import (
    LOOM,
    TINY,
    alive,
    children,
    finish,
    kill_all,
    start,
    steps_logged,
    wait_for,
)
from tests.parity.test_ft_diloco import chunks

pytest.importorskip("torchft")


def rows_of(folder: Path) -> list[dict]:
    return read_rows(folder / "metrics-0.jsonl")


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        kids = [c for p in todo if alive(p) for c in children(p)]
        found += kids
        todo = kids
    return found


def environ(pid: int, name: str) -> str:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(v for v in env if v.startswith(name.encode() + b"=")).split(b"=", 1)[1].decode()


def lighthouse_of(pid: int) -> tuple[str, int]:
    """The lighthouse address the launcher handed a group (its environment)."""
    where = urlparse(environ(pid, "LOOM_FT_LIGHTHOUSE"))
    return where.hostname or "localhost", int(where.port or 0)


def accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def ft_launch(tmp_path: Path, *flags: str):
    return start([*LOOM, "launch", "--ft-replica-groups", "2", "-n", "2", *LOOM, "train",
                  *TINY, "--outdir", str(tmp_path / "run"), "--ft-replica-groups", "2", *flags],
                 TMPDIR=str(tmp_path), RUST_LOG="warn")


@pytest.mark.multirank
def test_lighthouse_and_groups_end_with_a_sigkilled_launcher(tmp_path: Path) -> None:
    proc = ft_launch(tmp_path, "--max-steps", "100000")
    run = tmp_path / "run"
    wait_for(lambda: all(steps_logged(run / f"group-{g}") for g in range(2)), "first steps",
             240, proc)
    groups = children(proc.pid)
    everything = descendants(proc.pid)
    host, port = lighthouse_of(groups[0])
    try:
        assert len(groups) == 2 and len(everything) >= 4, everything  # 2 launches, 2 ranks
        assert accepts(host, port), "the lighthouse is not serving"
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        deadline = time.monotonic() + 15  # launches and ranks poll their parent every second
        while any(alive(p) for p in everything) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p for p in everything if alive(p)]
    finally:
        kill_all(everything)
    assert not left, f"{left} still running 15 s after the launcher was SIGKILLed"
    assert not accepts(host, port), "the lighthouse outlived its launcher"


def test_a_refusal_is_one_line_for_all_groups(tmp_path: Path) -> None:
    code, _, err = finish(ft_launch(tmp_path, "--max-steps", "1", "--dp-replicate", "2"), 240)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, (code, err)
    assert "--ft-replica-groups does not run with --dp-replicate 2" in lines[0], err
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.multirank
@pytest.mark.slow
def test_a_group_that_loses_a_rank_leaves_the_others_stepping(tmp_path: Path) -> None:
    """SIGKILL of group 1's rank 1 after its step 5 of 30 (no restart): group 0 discards at
    most the step the failure interrupted, then steps alone to the end; no step waits
    past the quorum timeout; tokens_seen counts only what each step trained."""
    steps, world = 30, ("--dp-shard", "2")
    proc = start([*LOOM, "launch", "--ft-replica-groups", "2", "-n", "4", *LOOM, "train", *TINY,
                  "--outdir", str(tmp_path / "run"), "--ft-replica-groups", "2", *world,
                  "--max-steps", str(steps)], TMPDIR=str(tmp_path), RUST_LOG="warn")
    run = tmp_path / "run"
    wait_for(lambda: steps_logged(run / "group-1") >= 5, "group 1's step 5", 240, proc)
    group1 = next(p for p in children(proc.pid) if environ(p, "LOOM_FT_GROUP") == "1")
    rank1 = next(p for p in children(group1) if environ(p, "RANK") == "1")
    os.kill(rank1, signal.SIGKILL)
    code, _, err = finish(proc, 240)
    assert code != 0 and "loom launch: replica group 1 exited" in err, (code, err[-3000:])
    assert "replica group 0" not in err, err[-3000:]
    rows = [r for r in rows_of(run / "group-0") if "train/loss" in r]
    assert [r["train/iter"] for r in rows] == list(range(1, steps + 1))
    discarded = [r["train/iter"] for r in rows if r["ft/committed"] == 0]
    assert len(discarded) <= 1, discarded
    assert rows[-1]["ft/participants"] == 1.0
    assert max(r["train/dt"] for r in rows) < QUORUM_TIMEOUT_S
    per_group = rows[0]["train/tokens_seen"] // 2  # the first step: both groups trained
    trained = sum(r["ft/committed"] * r["ft/participants"] * per_group for r in rows)
    assert rows[-1]["train/tokens_seen"] == trained
    summary = json.loads((run / "group-0" / "summary.json").read_text())["ft"]
    assert summary["steps_trained"] == steps - len(discarded), summary


@pytest.mark.multirank
@pytest.mark.slow
def test_a_diloco_group_left_alone_says_so_at_each_sync(tmp_path: Path) -> None:
    """--ft diloco --sync-every 5, group 1's rank 1 killed after its step 7 (no restart):
    group 0 trains to the end, and each sync it takes alone is a warning and a row whose
    ft/participants is 1 (a run that is no longer averaging across its groups is told)."""
    steps, sync = 30, 5
    proc = start([*LOOM, "launch", "--ft-replica-groups", "2", "-n", "4", *LOOM, "train", *TINY,
                  "--outdir", str(tmp_path / "run"), "--ft-replica-groups", "2", "--dp-shard",
                  "2", "--ft", "diloco", "--sync-every", str(sync), "--max-steps", str(steps)],
                 TMPDIR=str(tmp_path), RUST_LOG="warn")
    run = tmp_path / "run"
    wait_for(lambda: steps_logged(run / "group-1") >= 7, "group 1's step 7", 240, proc)
    kill_rank_1(proc.pid, 1)
    code, out, err = finish(proc, 240)
    assert code != 0 and "loom launch: replica group 1 exited" in err, (code, err[-3000:])
    rows = [r for r in rows_of(run / "group-0") if "train/loss" in r]
    assert [r["train/iter"] for r in rows] == list(range(1, steps + 1))
    alone = [r["train/iter"] for r in rows if r.get("ft/participants") == 1.0
             and r["train/iter"] % sync == 0]
    assert rows[sync - 1]["ft/participants"] == 2.0 and steps in alone, rows[-1]
    warned = (out + err).count("replica group 0 synced with 1 of 2 groups")
    assert warned == len(alone), (warned, alone)


def kill_rank_1(launcher: int, group: int) -> None:
    launch = next(p for p in children(launcher) if environ(p, "LOOM_FT_GROUP") == str(group))
    os.kill(next(p for p in children(launch) if environ(p, "RANK") == "1"), signal.SIGKILL)


@pytest.mark.multirank
@pytest.mark.slow
def test_killed_groups_restart_and_recover_live_from_a_healthy_one(tmp_path: Path) -> None:
    """SIGKILL of group 1's rank 1 after its step 10, again once it has rejoined, then of
    group 0's: each time the failed group's launch restarts it (--max-restarts 2) while the
    other trains on alone, the restarted group takes the healthy one's model, optimizer,
    schedule, step and data position live (no checkpoint is read), rejoins, and both
    groups end bit-identical (their final checkpoints' bytes). Enough steps that the run
    outlasts three restarts (~25 s each on a 2-core AMD EPYC, ~5 s on a Xeon)."""
    steps = 1200
    proc = start([*LOOM, "launch", "--ft-replica-groups", "2", "-n", "4", "--max-restarts", "2",
                  *LOOM, "train", *TINY, "--outdir", str(tmp_path / "run"),
                  "--ft-replica-groups", "2", "--dp-shard", "2", "--max-steps", str(steps),
                  "--checkpoint-interval", str(steps)], TMPDIR=str(tmp_path), RUST_LOG="warn")
    run = tmp_path / "run"

    def last(g: int) -> dict:
        rows = [r for r in rows_of(run / f"group-{g}") if "train/loss" in r] \
            if (run / f"group-{g}" / "metrics-0.jsonl").is_file() else []
        return rows[-1] if rows else {"train/iter": 0, "ft/participants": 0}

    wait_for(lambda: last(1)["train/iter"] >= 10, "group 1's step 10", 240, proc)
    for victim in (1, 1, 0):
        survivor = 1 - victim
        at = max(last(g)["train/iter"] for g in range(2))
        kill_rank_1(proc.pid, victim)
        # the survivor steps on (alone, or with the victim again where its restart beat the
        # lighthouse's heartbeat timeout); the victim's rows go on only once it rejoined
        wait_for(lambda s=survivor, a=at: last(s)["train/iter"] > a + 5,
                 "the survivor stepping on", 120, proc)
        wait_for(lambda v=victim, a=at: last(v)["train/iter"] > a + 5
                 and last(v)["ft/participants"] == 2, "the restarted group back", 240, proc)
    code, out, err = finish(proc, 600)
    assert code == 0, err[-3000:]
    # one per restart, and again where torchft discarded the join step (the healthy group
    # moved on by that step: the retried join takes its state once more)
    assert 3 <= out.count("recovered live from a healthy replica group") <= 6, out[-3000:]
    for g in range(2):
        rows = [r for r in rows_of(run / f"group-{g}") if "train/loss" in r]
        assert max(r["train/dt"] for r in rows) < QUORUM_TIMEOUT_S
        assert rows[-1]["train/iter"] == steps and rows[-1]["ft/participants"] == 2
    rows = [r for r in rows_of(run / "group-0") if "train/loss" in r]
    assert sum(r["ft/committed"] == 0 for r in rows) <= 2  # one per failure of group 1
    final = [run / f"group-{g}" / "checkpoints" / f"step-{steps}" for g in range(2)]
    shards = sorted(p.name for p in final[0].glob("*.distcp"))
    assert shards and shards == sorted(p.name for p in final[1].glob("*.distcp"))
    for name in [*shards, "loop.json"]:  # parameters, optimizer state, step, data position
        assert (final[0] / name).read_bytes() == (final[1] / name).read_bytes(), name


FAKE_SRUN = """#!{python}
# srun on one machine: runs CMD --ntasks times with Slurm's task variables and --export's
import os, subprocess, sys
args, flags = sys.argv[1:], {{}}
while args[0].startswith("--"):
    name, _, value = args.pop(0)[2:].partition("=")
    flags[name] = value
with open(os.environ["CALLS"], "a") as calls:
    calls.write(" ".join(sys.argv[1:]) + "\\n")
env = dict(os.environ)
env.update(item.split("=", 1) for item in flags["export"].split(",")[1:])
n = int(flags["ntasks"])
tasks = [subprocess.Popen(args, env={{**env, "SLURM_PROCID": str(r), "SLURM_NTASKS": str(n),
                                     "SLURM_LOCALID": str(r)}}) for r in range(n)]
sys.exit(max(t.wait() for t in tasks))
"""


@pytest.mark.multirank
def test_replica_groups_in_a_slurm_job_each_run_srun_on_their_own_nodes(tmp_path: Path) -> None:
    """Inside a (faked) two-node Slurm job, `loom launch --ft-replica-groups 2` starts the
    lighthouse and one launch per group, each running srun on its own node (localhost and
    127.0.0.1 stand for two nodes), and the groups train together."""
    bin_dir, calls, run = tmp_path / "bin", tmp_path / "calls", tmp_path / "run"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
    (bin_dir / "srun").chmod(0o755)
    proc = start([*LOOM, "launch", "--ft-replica-groups", "2", "-n", "1", *LOOM, "train",
                  *TINY, "--outdir", str(run), "--ft-replica-groups", "2", "--max-steps", "4"],
                 PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", CALLS=str(calls),
                 SLURM_JOB_ID="9", SLURM_JOB_NODELIST="localhost,127.0.0.1",
                 TMPDIR=str(tmp_path), RUST_LOG="warn")
    code, _, err = finish(proc, 300)
    assert code == 0, err[-3000:]
    lines = sorted(calls.read_text().splitlines())
    assert len(lines) == 2, lines
    assert "--nodelist=127.0.0.1 " in lines[0] and "MASTER_ADDR=127.0.0.1" in lines[0], lines
    assert "--nodelist=localhost " in lines[1] and "MASTER_ADDR=localhost" in lines[1], lines
    for g in range(2):
        summary = json.loads((run / f"group-{g}" / "summary.json").read_text())["ft"]
        assert summary["steps_trained"] == 4, summary
        rows = [r for r in rows_of(run / f"group-{g}") if "train/loss" in r]
        assert {r["ft/participants"] for r in rows} == {2.0}


@pytest.mark.multirank
@pytest.mark.slow
def test_a_killed_diloco_group_heals_at_the_next_sync(tmp_path: Path) -> None:
    """--ft diloco --sync-every 5: SIGKILL of group 1's rank 1 after its step 12; its launch
    restarts it, it trains from its own state until its next sync, whose quorum hands it
    group 0's weights, outer state and loop (live, logged), and from there the groups sync
    together: the last sync leaves bit-identical weights in both final checkpoints. The
    steps the restarted group trained before the heal are counted as discarded (its work
    there was dropped), as are those of a sync the failure broke."""
    steps, sync = 600, 5
    proc = start([*LOOM, "launch", "--ft-replica-groups", "2", "-n", "4", "--max-restarts", "1",
                  *LOOM, "train", *TINY, "--outdir", str(tmp_path / "run"),
                  "--ft-replica-groups", "2", "--dp-shard", "2", "--ft", "diloco",
                  "--sync-every", str(sync), "--max-steps", str(steps),
                  "--checkpoint-interval", str(steps)], TMPDIR=str(tmp_path), RUST_LOG="warn")
    run = tmp_path / "run"

    def last(g: int) -> dict:
        rows = [r for r in rows_of(run / f"group-{g}") if "train/loss" in r] \
            if (run / f"group-{g}" / "metrics-0.jsonl").is_file() else []
        return rows[-1] if rows else {"train/iter": 0}

    wait_for(lambda: last(1)["train/iter"] >= 12, "group 1's step 12", 240, proc)
    at = max(last(g)["train/iter"] for g in range(2))
    kill_rank_1(proc.pid, 1)
    wait_for(lambda: last(1)["train/iter"] > at + sync, "group 1 healed", 240, proc)
    code, out, err = finish(proc, 600)
    assert code == 0, err[-3000:]
    assert out.count("recovered live from a healthy replica group") >= 1, out[-3000:]
    final = [chunks(run / f"group-{g}" / "checkpoints" / f"step-{steps}") for g in range(2)]
    model = [k for k in final[0] if k[0].startswith("model.")]
    assert model and all(final[0][k] == final[1][k] for k in model), "the last sync's weights"
    summaries = [json.loads((run / f"group-{g}" / "summary.json").read_text())["ft"]
                 for g in range(2)]
    assert summaries[0]["steps_discarded"] <= sync, summaries  # the broken sync's cycle
    assert sync <= summaries[1]["steps_discarded"] <= 2 * sync, summaries  # before its heal
