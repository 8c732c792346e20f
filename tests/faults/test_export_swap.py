"""`loom export --overwrite` replaces a folder whole, one writer at a time, and a crash at
any step leaves the old export or the new one (`loom.runtime.staging`): a real export is
killed at each step of its swap and the next command recovers; a second writer is refused
in one line; a folder loom did not export, a mount point, a rename the filesystem refuses
and Ctrl-C are one line each with nothing changed. `--save-hf` and `loom tokenize` follow
the same rules."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from loom.cli import run_train
from loom.commands.tokenize import main as tokenize_main
from loom.runtime import staging
from loom.runtime.outputs import MARKER
from loom.runtime.staging import lock_path, lock_target
from tests.faults.procs import digest, finish, start, wait_for
from tests.faults.test_checkpoint_trust import TINY, loom
from tests.faults.test_hostile_outputs import export, one_error_line, snapshot

pytestmark = pytest.mark.usefixtures("loom_logger_restored")

LIMIT = 150.0
CHILD = """
import os, signal, sys, time
from pathlib import Path
from loom.runtime import staging

target, step, go = sys.argv[1:4]
real_rename, real_remove, real_exchange = os.rename, staging.remove_entry, staging.exchange

def pause():
    Path(go + ".ready").touch()
    while not os.path.exists(go):
        time.sleep(0.05)

def exchange(a, b):
    if step == "between":  # a system without the one-step exchange: two renames
        return False
    if step == "pause":  # holding the lock, at the swap
        pause()
    if step == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    done = real_exchange(a, b)
    if step == "after":
        os.kill(os.getpid(), signal.SIGKILL)
    return done

def rename(src, dst):
    src, dst = os.fspath(src), os.fspath(dst)
    if src == target and step == "pause":  # holding the lock, at the first rename
        pause()
    if src == target and step == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    real_rename(src, dst)
    if (step == "between" and src == target) or (step == "after" and dst == target):
        os.kill(os.getpid(), signal.SIGKILL)

def remove_entry(path):
    if step == "removing" and ".old-" in path.name:  # one file of the old export gone
        os.unlink(next(p for p in sorted(path.iterdir()) if p.is_file()))
        os.kill(os.getpid(), signal.SIGKILL)
    real_remove(path)

os.rename = rename
staging.remove_entry = remove_entry
staging.exchange = exchange
from loom.cli import main
main(["export", *sys.argv[4:]])
"""
"""`loom export ARGS` in a process that stops at one step of the swap: SIGKILL itself
(`before` it, `after` it, while `removing` the old folder; `between` the two renames of a
system without the one-step exchange) or wait for a file (`pause`), holding the lock."""


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run folder with checkpoints step-1 and step-2 (different weights)."""
    outdir = tmp_path_factory.mktemp("swap") / "run"
    proc = loom("train", *TINY, "--max-steps", "2", "--checkpoint-interval", "1",
                "--outdir", str(outdir))
    assert proc.returncode == 0, proc.stderr
    return outdir


@pytest.fixture(scope="module")
def exports(run: Path, tmp_path_factory) -> dict[str, Path]:
    """The step-1 export (the old one) and the step-2 export (the new one), as references."""
    folder = tmp_path_factory.mktemp("exports")
    for name, step in (("old", 1), ("new", 2)):
        checkpoint = run / "checkpoints" / f"step-{step}"
        assert export([str(checkpoint), str(folder / name), "--no-verify"]) == 0
    assert digest(folder / "old") != digest(folder / "new")
    return {"old": folder / "old", "new": folder / "new"}


def child(step: str, out: Path, run: Path, go: Path | None = None):
    checkpoint = run / "checkpoints" / "step-2"
    return start([sys.executable, "-c", CHILD, str(out), step, str(go), str(checkpoint),
                  str(out), "--overwrite", "--no-verify"])


def entries(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


@pytest.mark.parametrize("step, left, kept", [
    ("before", "old", "old"), ("between", None, "old"), ("after", "new", "new"),
    ("removing", "new", "new")])
def test_a_kill_at_each_step_of_the_swap_loses_nothing(run: Path, exports: dict[str, Path],
                                                       tmp_path: Path, capsys, step: str,
                                                       left: str | None, kept: str) -> None:
    out = Path(shutil.copytree(exports["old"], tmp_path / "out"))
    want = {name: digest(folder) for name, folder in exports.items()}
    code, _, err = finish(child(step, out, run), LIMIT)
    assert code == -signal.SIGKILL, err
    if left is None:  # between two renames: the old export, complete, waits beside it
        (old,) = (p for p in tmp_path.iterdir() if ".old-" in p.name)
        assert not out.exists() and digest(old) == want["old"]
    else:
        assert digest(out) == want[left]
    # the next command (a plain export) recovers, then refuses the folder it finds full
    code = export([str(run / "checkpoints" / "step-1"), str(out), "--no-verify"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [
        f"error: export folder {out} is not empty (it holds {MARKER} and "
        f"{len(os.listdir(out)) - 1} more); pass --overwrite to replace it whole, or choose "
        "another folder"]
    assert digest(out) == want[kept]
    assert entries(tmp_path) == ["out"], "a leftover or the lock file stayed"


def test_two_exports_into_one_folder_one_writes_and_one_is_refused(
        run: Path, exports: dict[str, Path], tmp_path: Path, capsys) -> None:
    out = Path(shutil.copytree(exports["old"], tmp_path / "out"))
    go = tmp_path / "go"
    first = child("pause", out, run, go)
    wait_for(lambda: Path(f"{go}.ready").exists(), "the first export at its swap", LIMIT,
             first)
    before = snapshot(tmp_path)
    code = export([str(run / "checkpoints" / "step-1"), str(out), "--overwrite",
                   "--no-verify"])
    one_error_line(code, capsys.readouterr().err, f"export folder {out} is being written "
                   f"by another loom command (pid {first.pid} on ", "wait for it")
    assert snapshot(tmp_path) == before, "the refused export changed something"
    go.touch()
    code, stdout, err = finish(first, LIMIT)
    assert code == 0 and "exported" in stdout, err
    assert digest(out) == digest(exports["new"])
    assert entries(tmp_path) == ["go", "go.ready", "out"]


Setup = Callable[[Path, pytest.MonkeyPatch, list], str]
"""(tmp_path holding `old`, an export; monkeypatch; files to close after) -> the line's text."""


def project(tmp: Path, monkeypatch, opened: list) -> str:
    (tmp / "out" / ".git").mkdir(parents=True)
    (tmp / "out" / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (tmp / "out" / "src").mkdir()
    (tmp / "out" / "src" / "main.py").write_text("print('mine')\n")
    return f"is not a loom export (no {MARKER}; it holds .git and 1 more)"


def model_from_elsewhere(tmp: Path, monkeypatch, opened: list) -> str:
    (tmp / "out").mkdir()
    (tmp / "out" / "config.json").write_text("{}")
    (tmp / "out" / "model.safetensors").write_bytes(b"weights")
    return "--overwrite replaces only a folder loom exported"


def mount_point(tmp: Path, monkeypatch, opened: list) -> str:
    (tmp / "out").mkdir()
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == tmp / "out" or real(p))
    return "is a mount point, which loom cannot replace whole"


def held(tmp: Path, monkeypatch, opened: list) -> str:
    """Another writer holds the lock (a second open file of this process: flock is per
    open file)."""
    shutil.copytree(tmp / "old", tmp / "out")
    opened.append(lock_target(tmp / "out", "export folder"))
    return f"is being written by another loom command (pid {os.getpid()} on "


def refused_rename(number: int, which: Callable[[Path, str, str], bool]) -> Setup:
    """The filesystem refuses one rename of the swap with `number` (EBUSY: the target is
    a mount point; EXDEV)."""
    def setup(tmp: Path, monkeypatch, opened: list) -> str:
        shutil.copytree(tmp / "old", tmp / "out")
        real = os.rename
        monkeypatch.setattr(staging, "exchange", lambda a, b: False)  # two renames

        def rename(src, dst) -> None:
            if which(tmp / "out", os.fspath(src), os.fspath(dst)):
                raise OSError(number, os.strerror(number))
            real(src, dst)
        monkeypatch.setattr(os, "rename", rename)
        return f"({os.strerror(number)}); {tmp / 'out'} was left as it was"
    return setup


def refused_exchange(tmp: Path, monkeypatch, opened: list) -> str:
    """The filesystem refuses the one-step exchange (EBUSY: the target is a mount point)."""
    shutil.copytree(tmp / "old", tmp / "out")

    def exchange(a, b) -> bool:
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
    monkeypatch.setattr(staging, "exchange", exchange)
    return f"({os.strerror(errno.EBUSY)}); {tmp / 'out'} was left as it was"


CASES: dict[str, Setup] = {
    "exchange-ebusy": refused_exchange,
    "project-folder": project,
    "model-folder-from-elsewhere": model_from_elsewhere,
    "mount-point": mount_point,
    "another-writer": held,
    "first-rename-ebusy": refused_rename(errno.EBUSY, lambda out, s, d: s == str(out)),
    "second-rename-exdev": refused_rename(errno.EXDEV,
                                          lambda out, s, d: ".partial-" in s),
    "rename-name-too-long": refused_rename(errno.ENAMETOOLONG,
                                           lambda out, s, d: s == str(out)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_overwrite_refuses_in_one_line_and_changes_nothing(
        run: Path, exports: dict[str, Path], tmp_path: Path, capsys, monkeypatch,
        case: str) -> None:
    shutil.copytree(exports["old"], tmp_path / "old")
    opened: list = []
    message = CASES[case](tmp_path, monkeypatch, opened)
    before = snapshot(tmp_path)
    try:
        code = export([str(run / "checkpoints" / "step-2"), str(tmp_path / "out"),
                       "--overwrite", "--no-verify"])
    finally:
        for lock in opened:
            lock.close()
    one_error_line(code, capsys.readouterr().err, message)
    assert snapshot(tmp_path) == before


def test_ctrl_c_while_writing_is_one_line_and_leaves_the_old_export(
        run: Path, exports: dict[str, Path], tmp_path: Path, capsys, monkeypatch) -> None:
    out = Path(shutil.copytree(exports["old"], tmp_path / "out"))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr("loom.hf.export.write_weights", interrupted)
    before = snapshot(tmp_path)
    code = export([str(run / "checkpoints" / "step-2"), str(out), "--overwrite"])
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGINT and "Traceback" not in err
    assert err.strip().splitlines() == [
        f"loom export: interrupted by Ctrl-C; {out} holds no partial export"]
    assert snapshot(tmp_path) == before


def test_ctrl_c_during_the_swap_waits_for_it(run: Path, exports: dict[str, Path],
                                             tmp_path: Path, capsys, monkeypatch) -> None:
    """SIGINT during the swap (here: right after the exchange) takes effect after it: the
    new export, whole."""
    out = Path(shutil.copytree(exports["old"], tmp_path / "out"))
    real = staging.exchange

    def exchange(a, b) -> bool:
        done = real(a, b)
        signal.raise_signal(signal.SIGINT)
        return done
    monkeypatch.setattr(staging, "exchange", exchange)
    code = export([str(run / "checkpoints" / "step-2"), str(out), "--overwrite",
                   "--no-verify"])
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGINT and "Traceback" not in err, err
    assert digest(out) == digest(exports["new"])
    assert entries(tmp_path) == ["out"]


def test_a_name_of_255_bytes_is_replaced_and_an_older_export_without_marker_too(
        run: Path, exports: dict[str, Path], tmp_path: Path, capsys) -> None:
    """The staging and old folders' names are longer than the target's; a name at the
    limit gets shortened ones. An export of a loom older than the marker (its
    generation_config.json says transformers_version "loom") is still loom's."""
    out = Path(shutil.copytree(exports["old"], tmp_path / ("é" * 100 + "x" * 55)))
    assert len(os.fsencode(out.name)) == 255
    (out / MARKER).unlink()
    code = export([str(run / "checkpoints" / "step-2"), str(out), "--overwrite",
                   "--no-verify"])
    assert code == 0, capsys.readouterr().err
    assert digest(out) == digest(exports["new"])
    assert entries(tmp_path) == [out.name]
    assert not lock_path(out).exists()


def test_a_failed_export_leaves_no_folder_it_made(run: Path, tmp_path: Path, capsys) -> None:
    """The checkpoint is read under the lock, after the folders above the target are made:
    a refusal then (here `--peft` of a run that trained every weight) removes them."""
    before = snapshot(tmp_path)
    code = export([str(run / "checkpoints" / "step-2"), str(tmp_path / "new" / "deeper" /
                                                             "out"), "--peft"])
    one_error_line(code, capsys.readouterr().err, "--peft needs a LoRA run's checkpoint")
    assert snapshot(tmp_path) == before


def test_save_hf_over_a_folder_loom_did_not_export_is_refused_before_training(
        tmp_path: Path, capsys) -> None:
    """`--save-hf` replaces `<run>/hf` whole after training: a folder of someone else's
    there is one line before the first step, not a loss after the last."""
    (tmp_path / "run" / "hf").mkdir(parents=True)
    (tmp_path / "run" / "hf" / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    code = run_train([*TINY, "--max-steps", "1", "--checkpoint-interval", "1", "--save-hf",
                      "--outdir", str(tmp_path / "run")])
    one_error_line(code, capsys.readouterr().err, "--save-hf folder",
                   "is not a loom export (no .loom-export; it holds notes.txt)")
    assert snapshot(tmp_path) == before


def test_tokenize_into_a_folder_another_tokenize_writes_is_refused(tmp_path: Path,
                                                                   capsys) -> None:
    """Two tokenizations into one OUT would interleave their parts: the second is refused
    in one line naming the first (here a lock held by this process, as `loom export`'s
    writer holds it), and nothing is written."""
    (tmp_path / "corpus.txt").write_text("a few words to tokenize\n" * 20)
    lock = lock_target(tmp_path / "out", "loom tokenize OUT")
    before = snapshot(tmp_path)
    try:
        code = tokenize_main([str(tmp_path / "corpus.txt"), str(tmp_path / "out"), "-j", "1"])
    finally:
        lock.close()
    one_error_line(code, capsys.readouterr().err, "loom tokenize OUT",
                   f"is being written by another loom command (pid {os.getpid()} on ")
    assert snapshot(tmp_path) == before


def test_the_exchange_swaps_two_folders_in_one_step(tmp_path: Path) -> None:
    """Where the system has it (Linux, glibc 2.28+: CI's), both names stay filled; a missing
    one is the system's error, which the swap reports in one line."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "new").touch()
    if not staging.exchange(tmp_path / "a", tmp_path / "b"):
        pytest.fail("renameat2(RENAME_EXCHANGE) is missing here: the swap takes two renames")
    assert entries(tmp_path / "b") == ["new"] and entries(tmp_path / "a") == []
    with pytest.raises(OSError) as caught:
        staging.exchange(tmp_path / "missing", tmp_path / "b")
    assert caught.value.errno == errno.ENOENT
