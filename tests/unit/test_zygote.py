"""The suite's fork server (`tests/zygote.py`) gives a process what a fresh interpreter would:
the same argv, path, working directory, environment, threads, signal dispositions, stream
buffering and exit code, for a script, a module and `-c` code."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests import zygote
from tests.harness import REPO, LoggedProcess, rank_env
from tests.zygote import ZygoteProcess

PROBE = """\
import json, os, signal, sys, tempfile
import torch
print(json.dumps({
    "argv": sys.argv[1:], "argv0": os.path.basename(sys.argv[0]), "path0": sys.path[0],
    "cwd": os.getcwd(), "rank": os.environ.get("RANK"), "only_here": os.environ.get("LOOM_PROBE"),
    "threads": torch.get_num_threads(), "name": __name__,
    "line_buffered": sys.stdout.line_buffering, "write_through": sys.stdout.write_through,
    "stderr_errors": sys.stderr.errors,
    "signals": [str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE)],
    "tmp": tempfile.gettempdir(),
}))
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("LOOM_PROBE_EXIT", "0")))
"""


def both(argv: list[str], env: dict[str, str], cwd: Path) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of `argv` started fresh and through the zygote."""
    zygote.zygote(env)  # the environment's first request: its zygote starts at the next
    forked = ZygoteProcess.start(argv, env, cwd)
    assert forked is not None, "the zygote refused a compatible request"
    results = []
    for proc in (LoggedProcess(argv, env, cwd), forked):
        out, err = proc.communicate(timeout=120)
        results.append((proc.returncode, out, err))
    return results


@pytest.mark.parametrize("form", ["script", "module", "code"])
def test_a_forked_process_is_what_a_fresh_interpreter_would_be(tmp_path: Path, form: str):
    (tmp_path / "probe_mod.py").write_text(PROBE)
    argv = {"script": [str(tmp_path / "probe_mod.py")], "module": ["-m", "probe_mod"],
            "code": ["-c", PROBE]}[form]
    env = rank_env(1, 2, 12345, {"LOOM_PROBE": "x", "LOOM_PROBE_EXIT": "7", "OMP_NUM_THREADS": "2",
                                 "TMPDIR": str(tmp_path)})
    fresh, forked = both([sys.executable, *argv, "a", "--b"], env, tmp_path)
    assert fresh == forked
    assert forked[0] == 7 and json.loads(forked[1])["argv"] == ["a", "--b"]


def test_an_exception_exits_1_with_the_traceback_python_prints(tmp_path: Path):
    code = "def f():\n    raise ValueError('bad')\nf()"
    fresh, forked = both([sys.executable, "-c", code], rank_env(0, 1, 1, None), tmp_path)
    assert fresh == forked and forked[0] == 1
    assert forked[2].startswith("Traceback") and forked[2].endswith("ValueError: bad\n")


def test_each_import_environment_has_its_own_zygote_from_its_second_request(tmp_path: Path):
    """A variable torch reads when it is imported (TORCH_LOGS) is honoured: such a request is
    never served by a zygote that imported torch without it; per-process variables (RANK,
    LOOM_*) are shared by one zygote."""
    env = {**rank_env(0, 1, 1, None), "TORCH_LOGS": "+dynamo", "LOOM_PROBE": "1"}
    code = "import logging, torch; print(logging.getLogger('torch._dynamo').level)"
    assert ZygoteProcess.start([sys.executable, "-c", code], env, tmp_path) is None, \
        "a first request starts fresh"
    second = ZygoteProcess.start([sys.executable, "-c", code],
                                 {**env, "RANK": "1", "LOOM_PROBE": "2"}, tmp_path)
    assert second is not None
    fresh = LoggedProcess([sys.executable, "-c", code], env, tmp_path)
    assert second.communicate(timeout=120)[0] == fresh.communicate(timeout=120)[0] == "10\n"
    server = zygote.zygote(env)
    assert server is not None and server is zygote.zygote({**env, "RANK": "3"})
    assert zygote.zygote({**env, "TORCH_LOGS": "+inductor"}) is None, "a new one: asked once"
    assert ZygoteProcess.start(["bash", "-c", "true"], dict(os.environ), REPO) is None


def test_a_path_to_another_loom_is_never_served_by_a_zygote(tmp_path: Path):
    """A PYTHONPATH naming another checkout's `src` (benchmarks/throughput.py --old-src) gets
    that checkout's loom, not the one a zygote imported from this checkout."""
    other = tmp_path / "other_src"
    (other / "loom").mkdir(parents=True)
    (other / "loom" / "__init__.py").write_text("WHERE = 'other'\n")
    (tmp_path / "plain").mkdir()
    env = {**rank_env(0, 1, 1, None), "PYTHONPATH": f"{other}{os.pathsep}{REPO}"}
    code = "import loom; print(getattr(loom, 'WHERE', 'this checkout'))"
    for _ in range(2):  # a second request would start a zygote for a servable environment
        assert ZygoteProcess.start([sys.executable, "-c", code], env, tmp_path) is None
    proc = LoggedProcess([sys.executable, "-c", code], env, tmp_path)
    assert proc.communicate(timeout=120)[0] == "other\n"
    assert not zygote.shadows_imported(f"{REPO}{os.pathsep}{REPO / 'src'}")
    assert not zygote.shadows_imported(str(tmp_path / "plain"))
