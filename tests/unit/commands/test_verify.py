"""`loom verify` without a process group: the layout grammar, the comparison, and bad input
(one line on stderr, exit 2, before any collective)."""

from __future__ import annotations

import sys

import pytest
import torch

from loom.commands.verify import (
    MOE_NOTE,
    Outcome,
    compare,
    format_table,
    notes_for,
    parse_layout,
    parse_request,
)
from loom.commands.verify import main as verify_main
from loom.config import ConfigError
from tests.harness import run_process

BASE = ["--model", "debug", "--dataset", "random", "--vocab-size", "512", "--seq-len", "64"]


def degrees(text: str) -> dict[str, str]:
    flags = parse_layout(text).flags
    return dict(zip(flags[0:14:2], flags[1:14:2], strict=True))


def test_layout_grammar_sets_every_degree():
    assert degrees("dp2 tp2") == {"--dp-replicate": "1", "--dp-shard": "2", "--tp": "2",
                                  "--pp": "1", "--cp": "1", "--ep": "1", "--etp": "1"}
    hsdp = degrees("hsdp2x2 ep2")
    assert (hsdp["--dp-replicate"], hsdp["--dp-shard"], hsdp["--ep"]) == ("2", "2", "2")
    assert degrees("pp2")["--dp-shard"] == "-1", "an unnamed dp-shard takes the remaining ranks"
    assert parse_layout("dp4 --lr 2e-3").flags[-2:] == ("--lr", "2e-3")


@pytest.mark.parametrize("text", ["", "dq4", "tp", "--lr 1", "dp2 x"])
def test_unreadable_layouts_are_refused(text: str):
    with pytest.raises(ConfigError):
        parse_layout(text)


def test_plan_keeps_the_global_batch_and_refuses_what_it_cannot_run():
    request = parse_request(["--layouts", "dp4", "dp2 tp2", "--steps", "3", *BASE], world_size=4)
    batch = [argv[argv.index("--batch-size") + 1] for argv in request.argvs]
    assert batch == ["1", "2"]
    assert all(argv[argv.index("--max-steps") + 1] == "3" for argv in request.argvs)
    with pytest.raises(ConfigError, match="all 4 ranks"):
        parse_request(["--layouts", "dp4", "dp2", *BASE], world_size=4)
    with pytest.raises(ConfigError, match="not divisible"):
        parse_request(["--layouts", "dp4", "tp4", "--global-batch-size", "2", *BASE], world_size=4)
    with pytest.raises(ConfigError, match="--tp"):
        parse_request(["--layouts", "dp4", "tp4", "--tp", "2", *BASE], world_size=4)


def outcome(scale: float = 1.0, shift: float = 0.0) -> Outcome:
    params = {"a": torch.ones(3), "b": torch.full((2, 2), 2.0) * scale, "c": torch.ones(2) * scale}
    return Outcome({1: 3.0, 2: 2.5 + shift}, {1: 1.0, 2: 0.5}, params)


def test_compare_names_the_first_parameter_beyond_tolerance():
    same = compare("x", outcome(), outcome(), rtol=1e-5, grad_rtol=1e-4, param_rtol=1e-3)
    assert same.ok and same.loss == same.grad_norm == same.params == 0.0
    assert same.first_differing is None
    off = compare("y", outcome(scale=1.1, shift=1e-3), outcome(), rtol=1e-5, grad_rtol=1e-4,
                  param_rtol=1e-3)
    assert not off.ok
    assert off.first_differing == "b", "the first in model order, not the worst"
    assert off.loss == pytest.approx(1e-3 / 2.5)
    assert compare("z", outcome(shift=1e-7), outcome(), rtol=1e-5, grad_rtol=1e-4,
                   param_rtol=1e-3).ok


def test_help_describes_the_grammar(capsys):
    assert verify_main(["--help"]) == 0
    assert "hsdp RxS" in capsys.readouterr().out


def test_a_failing_layout_without_a_differing_parameter_says_what_failed():
    verdict = compare("w", outcome(shift=1e-3), outcome(), rtol=1e-5, grad_rtol=1e-4,
                      param_rtol=1e-3)
    assert not verdict.ok and verdict.beyond == ("loss",)
    line = format_table([verdict], "ref", []).splitlines()[-1]
    assert line.endswith("FAIL    - (loss beyond tolerance)"), line


def test_bad_input_is_one_line_and_exit_2():
    proc = run_process([sys.executable, "-m", "loom", "verify", "--layouts", "dp1", "dq1",
                       *BASE], timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "dq1" in proc.stderr


def test_notes_warn_of_moe_routing_ties_and_mixed_precision():
    dense = parse_request(["--layouts", "dp4", "dp2 tp2", "--fp32", *BASE], world_size=4)
    assert len(notes_for(dense.base, dense.options)) == 1
    moe = parse_request(["--layouts", "dp4", "dp4 ep2", *BASE, "--model", "moe-debug",
                         "--dtype", "bf16"], world_size=4)
    notes = notes_for(moe.base, moe.options)
    assert any("--fp32" in n for n in notes) and MOE_NOTE in notes
