"""`loom launch --ft-replica-groups`: the lighthouse and every group end with the launcher,
a SIGKILLed one included, and a mistake is one line however many groups make it."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

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

pytest.importorskip("torchft")


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        kids = [c for p in todo if alive(p) for c in children(p)]
        found += kids
        todo = kids
    return found


def lighthouse_of(pid: int) -> tuple[str, int]:
    """The lighthouse address the launcher handed a group (its environment)."""
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    url = next(v for v in env if v.startswith(b"LOOM_FT_LIGHTHOUSE=")).split(b"=", 1)[1]
    where = urlparse(url.decode())
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
    code, _, err = finish(ft_launch(tmp_path, "--max-steps", "1", "--tp", "2"), 240)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, (code, err)
    assert "--ft-replica-groups does not run with --tp 2" in lines[0], err
    assert not os.path.exists(tmp_path / "run")
