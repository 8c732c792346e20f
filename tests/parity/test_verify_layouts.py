"""`loom verify` trains its layouts one after another in one process; each must train as it
would in a process of its own. Four cheap one-process layouts, three of which set
process-wide compiler options (compile, an activation budget), against four separate
`loom train` processes with the very flags verify gives each layout."""

from __future__ import annotations

import sys

import pytest

from loom.commands.verify import parse_request
from tests.compare import column
from tests.harness import REPO, LoggedProcess, free_port, rank_env

AOT = "--compile --compile-backend aot_eager"
LAYOUTS = ["dp1", f"dp1 {AOT} --act-mem-budget 0.5", f"dp1 {AOT}", "dp1 --ac block"]
"""The budget layout comes before the plain compiled one: a budget left behind would
change what the next compiled layout recomputes."""
BASE = ["--model", "debug", "--n-layers", "2", "--dataset", "random", "--vocab-size", "256",
        "--seq-len", "32", "--fp32", "--seed", "5", "--global-batch-size", "2"]
TIMEOUT_S = 900  # a hang limit for five processes on two loaded cores, not a speed check


def start(argv: list[str]) -> LoggedProcess:
    return LoggedProcess([sys.executable, "-m", "loom", *argv], rank_env(0, 1, free_port(), None),
                         cwd=REPO)


@pytest.mark.slow  # 81 s here (two loaded cores): five processes, two compiled runs each
def test_four_layouts_in_one_process_train_as_four_processes(tmp_path):
    request = parse_request(["--layouts", *LAYOUTS, "--steps", "3", *BASE], world_size=1)
    verify = start(["verify", "--layouts", *LAYOUTS, "--steps", "3", *BASE,
                    "--outdir", str(tmp_path / "verify")])
    alone = [start(["train", *argv, "--outdir", str(tmp_path / f"alone-{i}")])
             for i, argv in enumerate(request.argvs)]
    outputs = [p.communicate(timeout=TIMEOUT_S) for p in (verify, *alone)]
    for p, (out, err) in zip((verify, *alone), outputs, strict=True):
        assert p.returncode == 0, (p.args, out[-2000:], err[-3000:])
    for i, layout in enumerate(LAYOUTS):
        (folder,) = (tmp_path / "verify").glob(f"{i}-*")
        together, separate = column(folder), column(tmp_path / f"alone-{i}")
        assert sorted(separate) == [1, 2, 3], layout
        assert together == pytest.approx(separate, rel=1e-6, abs=0), layout
