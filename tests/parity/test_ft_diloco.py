"""--ft diloco: two replica groups (each --dp-shard 2) train alone between syncs and hold the
same weights after each; what crosses the groups is the weights once per sync, measured.

A sync step's checkpoint holds bit-identical model chunks in both groups (they trained on
different data between syncs, so only the outer step makes them equal), while the inner
optimizers' states differ (each group's own). Each rank counts the bytes it hands to the
allreduce across the groups: at H = 5 over 10 steps that is two syncs of its own shard of
the weights, and nothing on the other steps."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from loom.checkpoint.format import load_metadata
from loom.observability.metrics import read_rows
from tests.faults.procs import LOOM, TINY, finish, start
from tests.parity.test_ft_replica_groups import LAYOUTS

pytest.importorskip("torchft")

STEPS, SYNC_EVERY = 10, 5


def chunks(folder: Path, file: str | None = None) -> dict[tuple, bytes]:
    """A checkpoint's stored chunks (fqn, offset) -> their bytes (one rank's file, or all)."""
    found = {}
    for index, stored in load_metadata(folder).storage_data.items():
        if file is None or stored.file == file:
            with (folder / stored.file).open("rb") as f:
                f.seek(stored.offset)
                found[(index.fqn, tuple(index.offset))] = f.read(stored.length)
    return found


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["dp-shard", "tp", "pp"])
def test_diloco_groups_agree_after_each_sync_and_send_only_then(tmp_path: Path,
                                                                layout: str) -> None:
    run = tmp_path / "run"
    proc = start([*LOOM, "launch", "--ft-replica-groups", "2", "-n", "4", *LOOM, "train",
                  *TINY, "--outdir", str(run), "--ft-replica-groups", "2", *LAYOUTS[layout],
                  "--ft", "diloco", "--sync-every", str(SYNC_EVERY), "--max-steps", str(STEPS),
                  "--checkpoint-interval", str(STEPS)], TMPDIR=str(tmp_path), RUST_LOG="warn")
    code, _, err = finish(proc, 600)
    assert code == 0, err[-3000:]
    final = [run / f"group-{g}" / "checkpoints" / f"step-{STEPS}" for g in range(2)]
    saved = [chunks(folder) for folder in final]
    model = [key for key in saved[0] if key[0].startswith("model.")]
    optim = [key for key in saved[0] if key[0].startswith("optim.")]
    assert model and set(saved[0]) == set(saved[1])
    assert all(saved[0][k] == saved[1][k] for k in model), "the groups' weights after a sync"
    assert any(saved[0][k] != saved[1][k] for k in optim), "each group's own inner optimizer"
    # rank 0's file holds its shard of every weight; under tp the replicated ones (the
    # norms) are stored by one rank of the tp group but sent by each
    shard = sum(len(v) for k, v in chunks(final[0], "__0_0.distcp").items()
                if k[0].startswith("model."))
    for g in range(2):
        summary = json.loads((run / f"group-{g}" / "summary.json").read_text())
        assert summary["ft"]["steps_trained"] == STEPS
        rows = [r for r in read_rows(run / f"group-{g}" / "metrics-0.jsonl") if "train/loss" in r]
        assert {r["train/iter"]: r.get("ft/participants") for r in rows} == {
            step: None if step < SYNC_EVERY else 2.0 for step in range(1, STEPS + 1)}
        sent = [0.0] + [r["ft/bytes_sent"] for r in rows]
        sends = {step: after - before for step, (before, after)
                 in enumerate(itertools.pairwise(sent), start=1) if after != before}
        assert list(sends) == list(range(SYNC_EVERY, STEPS + 1, SYNC_EVERY)), sends
        per_sync = set(sends.values())
        assert len(per_sync) == 1 and summary["ft"]["bytes_sent"] == sum(sends.values())
        if layout == "tp":
            assert shard <= per_sync.pop() <= 1.01 * shard, (per_sync, shard)
        else:
            assert per_sync == {shard}, (per_sync, shard)
