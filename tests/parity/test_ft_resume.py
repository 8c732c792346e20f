"""--resume under --ft-replica-groups: a stopped job resumed from its groups' checkpoints
trains on exactly as the job that never stopped (both algorithms), and a group whose newest
checkpoint is older than the others' recovers live from them before it reads any data.

Each case compares the final checkpoints of a run of 2 x STEPS steps with those of a run of
STEPS steps resumed (--resume auto) to 2 x STEPS: the same bytes, parameters, optimizer
state and (DiLoCo) the last sync's weights and the outer momentum, in both groups."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.compare import column
from tests.faults.procs import LOOM, TINY, finish, start
from tests.parity.test_ft_diloco import chunks

pytest.importorskip("torchft")

STEPS = 6


def ft_run(outdir: Path, steps: int, *flags: str) -> str:
    """`loom launch` of 2 groups x --dp-shard 2 to `steps`, a checkpoint every 3 steps;
    returns the job's stdout (where the groups' log lines go)."""
    proc = start([*LOOM, "launch", "--ft-replica-groups", "2", "-n", "4", *LOOM, "train",
                  *TINY, "--outdir", str(outdir), "--ft-replica-groups", "2", "--dp-shard", "2",
                  "--max-steps", str(steps), "--checkpoint-interval", "3",
                  "--keep-checkpoints", "4", *flags], TMPDIR=str(outdir.parent),
                 RUST_LOG="warn")
    code, out, err = finish(proc, 600)
    assert code == 0, err[-3000:]
    return out + err


def assert_same_checkpoints(run: Path, straight: Path, step: int) -> None:
    for g in range(2):
        done = [folder / f"group-{g}" / "checkpoints" / f"step-{step}"
                for folder in (run, straight)]
        stored = [chunks(folder) for folder in done]
        assert set(stored[0]) == set(stored[1])
        differ = sorted({k[0] for k in stored[0] if stored[0][k] != stored[1][k]})
        assert not differ, f"group {g}: {differ[:5]}"
        assert column(run / f"group-{g}", "train/tokens_seen") == \
            column(straight / f"group-{g}", "train/tokens_seen")


@pytest.mark.multirank
def test_a_resumed_job_trains_on_as_the_one_that_never_stopped(tmp_path: Path) -> None:
    """--ft average: group 1's newest checkpoint is removed before the resume, so it starts
    from an older step than group 0 and takes group 0's state live (the log says so), then
    both read on from group 0's data position."""
    straight, run = tmp_path / "straight", tmp_path / "resumed"
    ft_run(straight, 2 * STEPS)
    ft_run(run, STEPS)
    shutil.rmtree(run / "group-1" / "checkpoints" / f"step-{STEPS}")
    log = ft_run(run, 2 * STEPS, "--resume", "auto")
    assert log.count("recovered live from a healthy replica group: step 6") == 1, log[-3000:]
    assert_same_checkpoints(run, straight, 2 * STEPS)
    recoveries = [json.loads((run / f"group-{g}" / "summary.json").read_text())["ft"][
        "recoveries"] for g in range(2)]
    assert recoveries == [[], [{"step": STEPS, "samples_seen": 4 * STEPS}]], recoveries
    steps = range(1, 2 * STEPS + 1)  # the rows of both runs: a recovery counts from its step on
    assert column(run / "group-1", "ft/recoveries") == {s: float(s > STEPS) for s in steps}
    assert column(run / "group-0", "ft/recoveries") == dict.fromkeys(steps, 0.0)


@pytest.mark.multirank
def test_a_resumed_diloco_job_keeps_its_outer_state(tmp_path: Path) -> None:
    """--ft diloco, a sync every 4 steps, resumed from step 6: mid-cycle, with the step-4
    sync's weights and one outer momentum (non-zero) that the checkpoint must hold for the
    step-8 and step-12 syncs to be the straight run's."""
    diloco = ("--ft", "diloco", "--sync-every", "4")
    straight, run = tmp_path / "straight", tmp_path / "resumed"
    ft_run(straight, 2 * STEPS, *diloco)
    ft_run(run, STEPS, *diloco)
    saved = chunks(run / "group-0" / "checkpoints" / f"step-{STEPS}")
    momentum = [v for k, v in saved.items() if k[0].startswith("executor.outer_momentum.")]
    assert momentum and any(v.strip(b"\0") for v in momentum), "no outer momentum saved"
    ft_run(run, 2 * STEPS, *diloco, "--resume", "auto")
    assert_same_checkpoints(run, straight, 2 * STEPS)


@pytest.mark.multirank
def test_a_diloco_group_resumed_from_an_older_checkpoint_takes_the_others_state_first(
        tmp_path: Path) -> None:
    """--ft diloco, group 1's newest checkpoint removed: resumed from step 3 (before the
    step-4 sync) while group 0 resumes from step 6, it takes group 0's state live before
    training, so both train steps 7-12 from the same place in the cycle and nothing of
    either is discarded; the step-12 sync leaves both with the same weights. Left to its
    own checkpoint, group 1 synced alone at its step 4 and healed only at group 0's step-8
    sync, dropping what it trained on the way."""
    diloco = ("--ft", "diloco", "--sync-every", "4")
    run = tmp_path / "resumed"
    ft_run(run, STEPS, *diloco)
    shutil.rmtree(run / "group-1" / "checkpoints" / f"step-{STEPS}")
    log = ft_run(run, 2 * STEPS, *diloco, "--resume", "auto")
    assert log.count("recovered live from a healthy replica group") == 1, log[-3000:]
    assert log.count(f"recovered live from a healthy replica group: step {STEPS}") == 1
    summaries = [json.loads((run / f"group-{g}" / "summary.json").read_text())["ft"]
                 for g in range(2)]
    assert [s["recoveries"] for s in summaries] == \
        [[], [{"step": STEPS, "samples_seen": 4 * STEPS}]], summaries
    assert [(s["steps_trained"], s["steps_discarded"]) for s in summaries] == [(STEPS, 0)] * 2
    final = [chunks(run / f"group-{g}" / "checkpoints" / f"step-{2 * STEPS}") for g in range(2)]
    model = [key for key in final[0] if key[0].startswith("model.")]
    assert model and all(final[0][k] == final[1][k] for k in model)
