"""benchmarks/device_check.py in its tiny CPU rehearsal: the same script and rows a GPU run
takes, at toy sizes, so the one run a lent GPU allows is known to work before it starts.
Also: a killed check leaves every row written so far readable, and its runs die with it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import REPO

SCRIPT = REPO / "benchmarks" / "device_check.py"
sys.path.insert(0, str(REPO / "benchmarks"))
from devcheck.catalogue import rows_for  # noqa: E402
from devcheck.loomrow import timed_steps  # noqa: E402
from devcheck.trace import merged_busy, summarise  # noqa: E402

TINY = {r.name: r for r in rows_for("tiny")}
TINY_ROWS = list(TINY)
RAN_OK = [r for r in TINY_ROWS if r != "moe"]
"""moe: loom's one-process MoE under bf16 autocast on a CPU is issue #54's item 3; its row
must be recorded and the check go on, whatever it says."""


def check(out: Path, work: Path, *extra: str, mode: str = "tiny", **popen):
    env = {**os.environ, "LOOM_DEVICE_CHECK": mode, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, str(SCRIPT), str(out), "--work", str(work), *extra]
    if popen:
        return subprocess.Popen(argv, env=env, **popen)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)


def lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]


def test_tiny_rehearsal_writes_every_row(tmp_path):
    out = tmp_path / "out"
    proc = check(out, tmp_path / "work", "--budget-s", "600")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = lines(out)
    assert [r["row"] for r in records] == ["setup", "plans", "matmul", *TINY_ROWS, "end"]
    whole = json.loads((out / "device_check.json").read_text())
    assert whole["complete"] and whole["rows"] == records
    assert sorted(p.name for p in out.iterdir()) == [
        "device_check.json", "device_check.md", "profile.json", "rows.jsonl"]
    rows = {r["row"]: r for r in records}
    for name in RAN_OK:
        r = rows[name]
        loom = r["loom"]
        assert loom["status"] == "ok", (name, loom)
        assert loom["timed_steps"] == len(timed_steps(TINY[name])) > 0, (name, loom)
        assert loom["step_s"] > 0 and loom["tokens_per_s"] > 0, (name, loom)
        assert r["mfu_datasheet_pct"] > 0 and r["mfu_matmul_pct"] > 0, (name, r)
        assert r["plan"]["ok"] and r["plan"]["plan_step_s"] > 0, (name, r["plan"])
        assert r["ac"] == "none" == loom["ac"], "a toy fits without recompute"
    assert rows["moe"]["loom"]["status"] == "ok" or \
        rows["moe"]["loom"]["status"].startswith("failed: exit")
    plain = rows["s-b4"]["plain"]
    assert plain["status"] == "ok" and plain["parameters"] == rows["s-b4"]["loom"]["parameters"]
    assert rows["s-b4"]["vs_plain"] > 0
    titan = rows["s-b4"]["titan"]
    if titan["status"] == "ok":
        assert titan["same_parameter_count"] and titan["torchtitan"] == "0.2.2", titan
    else:
        assert titan["status"].startswith("not run: torchtitan does not import"), titan
    assert rows["loss-chunked"]["vs_base"] > 0 and rows["loss-chunked"]["base"] == "loss-eager"
    profile = rows["s-b4"]["profile"]  # steps 6-9 profiled, 3..5 timed
    assert profile["steps"] == 3 and profile["sdpa_ops"], profile
    assert json.loads((out / "profile.json").read_text())["steps"] == 3
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + len(TINY_ROWS), proc.stdout
    assert (out / "device_check.md").read_text().splitlines() == table
    assert "[device-check" in proc.stderr and "[device-check" not in proc.stdout


def alive_under(folder: Path) -> list[int]:
    """Processes whose command line names `folder` (the check's runs)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if str(folder).encode() in cmdline and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def test_a_killed_check_leaves_its_rows_readable(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = check(out, work, "--rows", "s-b4", "--no-wheels", "--budget-s", "600",
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240
    try:  # kill it while s-b4's loom run is under way: setup, plans and matmul are written
        while time.monotonic() < deadline and not (work / "s-b4").exists():
            assert proc.poll() is None, "the check ended before its first row started"
            time.sleep(0.2)
        assert (work / "s-b4").exists(), "s-b4 never started"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    records = lines(out)
    assert [r["row"] for r in records] == ["setup", "plans", "matmul"]
    whole = json.loads((out / "device_check.json").read_text())
    assert whole["rows"] == records and whole["complete"] is False
    for _ in range(50):  # the run dies with the check (PR_SET_PDEATHSIG)
        if not alive_under(work):
            break
        time.sleep(0.1)
    assert not alive_under(work), "a run outlived the killed check"


def test_unknown_mode_is_one_line_and_exit_2(tmp_path):
    proc = check(tmp_path / "out", tmp_path / "work", mode="cuda-please")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "LOOM_DEVICE_CHECK must be gpu or tiny" in proc.stderr
    proc = check(tmp_path / "out", tmp_path / "work", "--rows", "s-b4", "nope")
    assert proc.returncode == 2 and proc.stderr.strip() == "error: no such tiny row: nope"
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine")
def test_gpu_mode_without_a_gpu_says_so(tmp_path):
    proc = check(tmp_path / "out", tmp_path / "work", mode="gpu")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "nvidia-smi found no GPU" in proc.stderr and not (tmp_path / "out").exists()


def test_trace_summary_counts_idle_gpu_time(tmp_path):
    """Two steps; kernels busy 0-30 and 20-50 (overlap) and 80-100 of a 0-100 span."""
    events = [{"ph": "X", "name": "ProfilerStep#1", "cat": "user_annotation", "ts": 0,
               "dur": 50}, {"ph": "X", "name": "ProfilerStep#2", "cat": "user_annotation",
                            "ts": 50, "dur": 55},
              {"ph": "X", "name": "aten::_scaled_dot_product_cudnn_attention",
               "cat": "cpu_op", "ts": 1, "dur": 2},
              {"ph": "X", "name": "gemm", "cat": "kernel", "ts": 0, "dur": 30},
              {"ph": "X", "name": "cudnn_generated_fort_native_sdpa_sm90_flash_fprop",
               "cat": "kernel", "ts": 20, "dur": 30},
              {"ph": "X", "name": "gemm", "cat": "kernel", "ts": 80, "dur": 20},
              {"ph": "i", "name": "marker", "ts": 5}, "not an event"]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    summary = summarise(path)
    assert summary["steps"] == 2 and summary["span_ms"] == pytest.approx(0.105)
    assert summary["gpu_idle_fraction"] == pytest.approx(0.3)
    assert summary["sdpa_ops"] == {"cudnn": 1}
    assert summary["sdpa_kernels"] == ["cudnn_generated_fort_native_sdpa_sm90_flash_fprop"]
    assert merged_busy([(0, 1), (2, 3), (2.5, 4)]) == pytest.approx(3.0)


def test_every_gpu_row_resolves_for_torchtitan_on_a_cpu():
    """The torchtitan row reads loom's resolved configuration (`titan.loom_shape`); the
    CPU rehearsal cannot run torchtitan, so a field that moves (MoE's flags did, in issue
    #56) would break only the GPU run. Each GPU row's shape resolves here instead."""
    from devcheck.catalogue import gpu_rows

    sys.path.insert(0, str(REPO / "benchmarks" / "devcheck"))  # titan.py runs as a script
    import loom.families  # noqa: F401  (registers the model families)
    from devcheck.titan import loom_shape
    from loom.config import parse_args
    from loom.models.resolve import model_args

    for row in gpu_rows():
        if not row.titan:
            continue
        shape = loom_shape(list(row.flags))
        args = model_args(parse_args(list(row.flags)))
        assert (shape["dim"], shape["n_layers"]) == (args.dim, args.n_layers), row.name
        assert shape["loom_parameters"] > 0, row.name
    moe = next(r for r in gpu_rows() if r.name == "moe")
    with pytest.raises(SystemExit, match="no mixture of experts"):
        loom_shape(list(moe.flags))
