"""`loom doctor`: the report's facts come from the code that acts on them, and `--json` is
one JSON object alone on stdout even when the peak measurement warns."""

import json
import logging
import os
import sys

import pytest
import torch

from loom.cli import main as loom_main
from loom.commands import doctor
from loom.numerics.precision import resolve_precision
from loom.observability import flops
from tests.harness import run_process

BUSY = flops.PeakMeasurement(2e9, 0.49, 6, clean=False)
IDLE = flops.PeakMeasurement(3e11, 1.0, 2, clean=True)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    for name in ("SLURM_JOB_ID", "PBS_JOBID"):
        monkeypatch.delenv(name, raising=False)
    logger = logging.getLogger("loom")
    before, level = list(logger.handlers), logger.level
    yield tmp_path
    logger.handlers[:], logger.level = before, level


def run_doctor(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        loom_main(["doctor", *argv])
    out, err = capsys.readouterr()
    return int(exit_.value.code), out, err


def test_json_is_pure_json_with_every_fact(cache, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(flops, "measure_matmul_peak", lambda device, dtype: BUSY)
    code, out, err = run_doctor(["--json", "--outdir", str(tmp_path / "runs")], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["torch"] == torch.__version__
    auto = resolve_precision("auto", torch.device(report["run_device"]))
    assert report["precision"]["auto_dtype"] == auto.dtype
    assert isinstance(report["precision"]["native_bf16"], bool)
    assert report["peak"] == {"dtype": auto.dtype, "tflops": 0.002, "threads":
                              torch.get_num_threads(),
                              "source": "measured now on a busy machine, not cached"}
    assert report["backends"]["gloo"] is True
    assert report["launch"]["launcher"] == "local"
    assert "--no-python loom train" in report["launch"]["command"]
    assert report["disk"]["outputs"]["free_gib"] > 0 and report["devices"]
    assert "busy machine" in err, err


def test_text_report_is_one_screen_and_a_clean_peak_is_cached_once(cache, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(flops, "measure_matmul_peak",
                        lambda device, dtype: calls.append(dtype) or IDLE)
    code, first, _ = run_doctor([], capsys)
    code2, second, _ = run_doctor([], capsys)
    assert code == code2 == 0 and len(calls) == 1, calls
    assert "(measured now, cached" in first and "(cached measurement" in second, second
    lines = second.splitlines()
    assert len(lines) <= 24, second
    for fact in ("torch " + torch.__version__, "--dtype auto picks", "TFLOP/s", "backends",
                 "launch", "disk"):
        assert fact in second, (fact, second)


def test_launcher_follows_the_scheduler_environment():
    slurm = doctor.launcher({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]",
                             "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "4"})
    assert slurm["launcher"] == "slurm" and slurm["command"].startswith("srun"), slurm
    pbs = doctor.launcher({"PBS_JOBID": "7"})  # no PBS_NODEFILE: what launch would say
    assert pbs["launcher"] == "pbs" and "PBS_NODEFILE" in pbs["error"], pbs


def test_free_disk_reads_the_nearest_existing_folder(tmp_path):
    assert doctor.free_disk(tmp_path / "not" / "yet")["free_gib"] > 0


def test_the_command_prints_only_json(tmp_path):
    """End to end, with the real matmul benchmark: whatever it warns goes to stderr."""
    env = {**os.environ, "LOOM_CACHE_DIR": str(tmp_path)}
    for name in ("SLURM_JOB_ID", "PBS_JOBID"):
        env.pop(name, None)
    done = run_process([sys.executable, "-m", "loom", "doctor", "--json"], env=env,
                       timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["peak"]["tflops"] > 0 and report["peak"]["source"].startswith("measured")
