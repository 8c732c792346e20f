"""stdout is for results: a command's `--json` output is the only thing on its stdout, so
`json.loads` of it works even when loom has a warning to give (issue 34)."""

import json
import logging

import pytest

from loom.observability import flops
from loom.plan import command as plan_command

BUSY = flops.PeakMeasurement(2e9, 0.49, 6, clean=False)
"""What the matmul benchmark returns while other processes hold the CPUs."""


@pytest.fixture
def loom_handlers():
    """setup_logging adds a handler bound to the captured stream; drop it afterwards."""
    logger = logging.getLogger("loom")
    before, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:], logger.level = before, level


def test_plan_json_is_pure_json_on_a_busy_machine(tmp_path, monkeypatch, capsys,
                                                   loom_handlers):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flops, "measure_matmul_peak", lambda device, dtype: BUSY)
    code = plan_command.main(["--model", "debug", "--fp32", "--seq-len", "64",
                              "--cache-dir", str(tmp_path), "--world-size", "1",
                              "--device-memory", "1GiB", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    plan = json.loads(out)
    assert plan["fits"] is True and plan["world_size"] == 1, plan
    assert "busy machine" in err and "busy machine" not in out, (out, err)
