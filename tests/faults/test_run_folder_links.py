"""A run folder from elsewhere cannot make loom write outside it: links among its entries are
refused, JSON is written by rename, appends and the lock never follow a link, and only
folders with loom's marker are treated (or moved aside) as runs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loom.config import ConfigError, parse_args
from loom.observability.metrics import read_rows
from loom.observability.metrics.rows import is_step_row
from loom.runtime.rundir import LOCK_NAME, MARKER, claim
from loom.safe_io import open_append, open_lock_file, read_json_capped, write_text_atomic
from tests.faults.procs import digest
from tests.harness import REPO, free_port, rank_env, run_process

TINY = ["--model", "debug", "--dim", "32", "--n-layers", "1", "--n-heads", "2",
        "--n-kv-heads", "1", "--vocab-size", "64", "--seq-len", "16", "--dataset", "random",
        "--fp32", "--seed", "3", "--max-steps", "1"]


def loom_run(*argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return run_process([sys.executable, "-m", "loom", *argv], cwd=cwd,
                       env=rank_env(0, 1, free_port(), {}), timeout=150)


def marked_run(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / MARKER).write_text("a loom run folder\n")
    (folder / "config.json").write_text("{}\n")
    (folder / "metrics-0.jsonl").write_text('{"train/iter": 1}\n')
    return folder


LINKED_ENTRIES = [".lock", "config.json", "summary.json", "metrics-0.jsonl", "plots",
                  "eval-step-2", "plots/loss.png", "checkpoints/step-2",
                  "checkpoints/step-2/loop.json", MARKER]


@pytest.mark.parametrize("entry", LINKED_ENTRIES)
@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-file", "dangling"])
def test_a_link_among_the_known_entries_is_refused_and_nothing_is_written(
        tmp_path: Path, entry: str, dangling: bool) -> None:
    run = marked_run(tmp_path / "run")
    target = tmp_path / "victim"
    if not dangling:
        target.write_text("precious\n")
    (run / entry).parent.mkdir(parents=True, exist_ok=True)
    (run / entry).unlink(missing_ok=True)
    os.symlink(target, run / entry)
    before = digest(tmp_path)
    message = f"{entry} is a symbolic link; loom never writes through links"
    if entry == MARKER:  # a linked marker marks nothing: the folder is no loom run
        message = "is not a loom run folder|non-empty folder that is not a loom run"
    for resume, overwrite in [(True, False), (False, True), (False, False)]:
        with pytest.raises(ConfigError, match=message):
            claim(run, resume=resume, overwrite=overwrite)
    assert digest(tmp_path) == before
    assert target.exists() is not dangling


def test_the_run_folder_itself_being_a_link_is_refused(tmp_path: Path) -> None:
    real = marked_run(tmp_path / "real")
    os.symlink(real, tmp_path / "run")
    with pytest.raises(ConfigError, match="is a symbolic link; loom writes only into real"):
        claim(tmp_path / "run", resume=True, overwrite=False)


def test_atomic_json_replaces_a_link_instead_of_writing_through_it(tmp_path: Path) -> None:
    victim = tmp_path / "profile.sh"
    victim.write_text("export SAFE=1\n")
    os.symlink(victim, tmp_path / "summary.json")
    write_text_atomic(tmp_path / "summary.json", '{"evil": "$(touch pwned)"}\n')
    assert victim.read_text() == "export SAFE=1\n"
    assert not (tmp_path / "summary.json").is_symlink()
    assert read_json_capped(tmp_path / "summary.json") == {"evil": "$(touch pwned)"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.sh", "summary.json"]


@pytest.mark.parametrize("opener", [open_append, open_lock_file])
def test_appends_and_the_lock_never_follow_a_link(tmp_path: Path, opener) -> None:
    victim = tmp_path / "victim"
    victim.write_text("x\n")
    os.symlink(victim, tmp_path / "file")
    os.symlink(tmp_path / "absent", tmp_path / "dangling")
    for name in ("file", "dangling"):
        with pytest.raises(OSError):
            opener(tmp_path / name)
    assert victim.read_text() == "x\n" and not (tmp_path / "absent").exists()


def test_a_non_empty_folder_without_the_marker_is_refused_unless_adopted(tmp_path: Path
                                                                          ) -> None:
    model = tmp_path / "hf-model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (model / "model.safetensors").write_bytes(b"weights")
    before = digest(tmp_path)
    with pytest.raises(ConfigError, match="is not a loom run folder .* --overwrite moves only "
                                          "loom run folders"):
        claim(model, resume=False, overwrite=True)
    with pytest.raises(ConfigError, match="non-empty folder that is not a loom run"):
        claim(model, resume=False, overwrite=False)
    with pytest.raises(ConfigError, match="non-empty folder that is not a loom run"):
        claim(model, resume=True, overwrite=False)
    assert digest(tmp_path) == before and [p.name for p in tmp_path.iterdir()] == ["hf-model"]
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me\n")
    lock, _ = claim(notes, resume=False, overwrite=False, adopt=True)
    lock.close()
    assert (notes / MARKER).is_file() and (notes / "todo.txt").read_text() == "keep me\n"


def test_overwrite_moves_a_marked_run_and_marks_the_new_one(tmp_path: Path) -> None:
    run = marked_run(tmp_path / "run")
    lock, _ = claim(run, resume=False, overwrite=True)
    lock.close()
    (aside,) = tmp_path.glob("run.old-*")
    assert (aside / MARKER).is_file() and (aside / "config.json").is_file()
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME, MARKER]


def test_tilde_in_a_toml_outdir_is_expanded_like_the_flag(tmp_path: Path,
                                                          monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    toml = tmp_path / "run.toml"
    toml.write_text('[output]\noutdir = "~/runs/a"\n[checkpoint]\nresume = "~/runs/a/x"\n')
    from_file = parse_args(["--config", str(toml)])
    from_flag = parse_args(["--outdir=~/runs/a", "--resume=~/runs/a/x"])
    assert from_file.output.outdir == from_flag.output.outdir == f"{tmp_path}/runs/a"
    assert from_file.checkpoint.resume == f"{tmp_path}/runs/a/x"


@pytest.mark.multirank
def test_loom_train_refuses_a_linked_config_json_in_one_line(tmp_path: Path) -> None:
    run = marked_run(tmp_path / "run")
    rc = tmp_path / "bashrc"
    rc.write_text("echo hi\n")
    (run / "config.json").unlink()
    os.symlink(rc, run / "config.json")
    proc = loom_run("train", *TINY, "--outdir", str(run), "--overwrite")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"error: --outdir {run}: config.json is a symbolic link; "
                                   "loom never writes through links in a run folder: remove "
                                   "it or choose another folder"), proc.stderr
    assert rc.read_text() == "echo hi\n" and not list(tmp_path.glob("run.old-*"))


def test_a_run_of_a_loom_before_the_marker_resumes_once_adopted(tmp_path: Path) -> None:
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "config.json").write_text("{}\n")
    (legacy / "metrics-0.jsonl").write_text('{"train/iter": 1}\n')
    with pytest.raises(ConfigError, match="older than the marker"):
        claim(legacy, resume=True, overwrite=False)
    lock, _ = claim(legacy, resume=True, overwrite=False, adopt=True)
    lock.close()
    assert (legacy / MARKER).is_file()
    claim(legacy, resume=True, overwrite=False)[0].close()  # marked now: no flag needed


def test_crafted_metrics_rows_are_left_out_not_a_traceback(tmp_path: Path, caplog) -> None:
    good = {"train/iter": 1, "train/loss": 4.2, "train/tokens_seen": 16}
    path = tmp_path / "metrics-0.jsonl"
    path.write_text("\n".join([json.dumps(good), '{"train/iter": "x"}', "[" * 100_000,
                               json.dumps({**good, "train/iter": 2, "train/loss": "$(id)"}),
                               "not json", "", json.dumps({**good, "train/iter": 3})]) + "\n")
    with caplog.at_level(logging.WARNING, logger="loom"):
        assert [r["train/iter"] for r in read_rows(path, is_step_row)] == [1, 3]
    assert caplog.messages == [f"{path}: 4 lines that are not step rows left out"]
    path.unlink()
    os.mkfifo(path)
    assert read_rows(path) == []  # a FIFO: refused at once, never read
    path.unlink()
    with path.open("wb") as f:
        f.truncate(8 << 30)  # sparse: one 8 GB line of zero bytes
    assert read_rows(path) == []


def test_a_planted_temporary_name_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    os.symlink(victim, tmp_path / f".summary.json.{os.getpid()}.tmp")
    write_text_atomic(tmp_path / "summary.json", "{}\n")
    assert victim.read_text() == "keep\n" and (tmp_path / "summary.json").read_text() == "{}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json", "victim"]
