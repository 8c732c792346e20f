"""`loom plan --failures`: the goodput model against hand calculations, its optimum against a
search, and the command's output and refusals (docs/faults.md)."""

import json
import math
from dataclasses import fields, replace
from pathlib import Path

import pytest

from loom.plan import command as plan_command
from loom.plan.failures import (
    LLAMA3_RATE,
    FailureModel,
    best_interval,
    daly_interval,
    goodput,
    replica_groups,
    whole_job_restart,
    young_interval,
)

DOCS = Path(__file__).resolve().parents[3] / "docs"
HAND = FailureModel(failure_rate=0.0036, checkpoint_interval_s=100.0, save_time_s=10.0,
                    restart_time_s=50.0, ft_replica_groups=4, recovery_time_s=40.0,
                    ft_stall_s=5.0, whole_job_share=0.1)
"""1000 devices at 0.0036 per device-hour: the job fails 3.6 times an hour, M = 1000 s."""


def test_llama3_rate_is_419_interruptions_in_54_days_on_16384_devices():
    per_device_hour = LLAMA3_RATE
    assert per_device_hour == pytest.approx(1.9733e-5, rel=1e-4)
    job_mtbf_h = 1 / (16_384 * per_device_hour)
    assert job_mtbf_h == pytest.approx(54 * 24 / 419)  # "about one every three hours"
    assert 3.0 < job_mtbf_h < 3.2


def test_whole_job_restart_matches_a_hand_calculation():
    # tau 100, delta 10, R 50, M 1000: 100 / (1000 e^0.05 (e^0.11 - 1))
    # = 100 / (1000 x 1.0512711 x 0.1162781) = 100 / 122.2398 = 0.818064
    s = whole_job_restart(HAND, 1000)
    assert s.goodput == pytest.approx(100 / (1000 * 1.0512711 * 0.1162781), rel=1e-6)
    assert s.goodput == pytest.approx(0.818064, abs=1e-6)


def test_replica_groups_match_a_hand_calculation():
    # contained: 0.9 of 0.001/s, each costing 40/4 + 5 = 15 s of the job: 1 - 0.0135 kept;
    # whole-job: 0.1 of 0.001/s, M = 10000 s: 100 / (10000 e^0.005 (e^0.011 - 1))
    s = replica_groups(HAND, 1000)
    restart_part = 100 / (10_000 * 1.0050125 * 0.01106072)
    assert s.goodput == pytest.approx(restart_part * (1 - 0.0135), rel=1e-6)
    assert s.goodput == pytest.approx(0.887446, abs=1e-6)
    assert s.name == "replica groups (4 x 250)"


def test_small_rates_agree_with_the_first_order_loss():
    """At M >> tau: the save's share lost, and of the rest half an interval (with its save)
    and a restart per failure, to first order in 1/M."""
    tau, delta, r, m = 600.0, 6.0, 120.0, 1e7
    first_order = tau / (tau + delta) * (1 - ((tau + delta) / 2 + r) / m)
    assert goodput(tau, delta, r, m) == pytest.approx(first_order, abs=1e-9)
    assert goodput(tau, delta, r, m) == pytest.approx(0.9900571, abs=1e-7)


@pytest.mark.parametrize("save, mtbf", [(30.0, 11_135.0), (10.0, 1000.0), (600.0, 3600.0),
                                        (1.0, 1e6), (5000.0, 3600.0)])
def test_best_interval_is_the_maximum_a_search_finds(save, mtbf):
    best = best_interval(save, mtbf)
    grid = [mtbf * k / 20_000 for k in range(1, 20_000)]
    searched = max(grid, key=lambda tau: goodput(tau, save, 300.0, mtbf))
    assert best == pytest.approx(searched, abs=mtbf / 20_000)
    top = goodput(best, save, 300.0, mtbf)
    assert top >= goodput(searched, save, 300.0, mtbf)
    assert top > goodput(best * 1.01, save, 300.0, mtbf)
    assert top > goodput(best * 0.99, save, 300.0, mtbf)


def test_best_interval_keeps_its_precision_far_below_young_scale():
    """A save a trillion times shorter than M: u ~ 1e-6, still found to the last digits."""
    save, mtbf = 1e-3, 1e9
    best = best_interval(save, mtbf)
    u = best / mtbf
    assert math.log1p(-u) + u + save / mtbf == pytest.approx(0.0, abs=1e-18)
    assert best == pytest.approx(young_interval(save, mtbf), rel=1e-5)


def test_young_and_daly_approximate_the_optimum_when_saves_are_short():
    save, mtbf = 30.0, 11_135.0
    best = best_interval(save, mtbf)
    assert young_interval(save, mtbf) == pytest.approx(math.sqrt(2 * 30 * 11_135))
    assert young_interval(save, mtbf) == pytest.approx(best, rel=0.03)
    assert best <= young_interval(save, mtbf)  # ln(1 - u) + u <= -u^2 / 2
    assert daly_interval(save, mtbf) == pytest.approx(best, rel=0.002)


def test_without_whole_job_failures_no_interval_is_best():
    s = replica_groups(replace(HAND, whole_job_share=0.0), 1000)
    assert s.best_interval_s is None
    assert s.goodput == pytest.approx(100 / 110 * (1 - 0.001 * 15))
    assert s.best_goodput == pytest.approx(1 - 0.001 * 15)


def test_a_job_failing_faster_than_it_saves_has_no_goodput_and_no_overflow():
    s = whole_job_restart(replace(HAND, failure_rate=1.0), 10**9)
    assert s.goodput == 0.0 and s.best_goodput >= 0.0
    assert replica_groups(replace(HAND, failure_rate=1.0), 10**9).goodput == 0.0


def test_the_command_prints_both_goodputs_for_llama3_scale(capsys):
    assert plan_command.main(["--failures", "--world-size", "16384"]) == 0
    out = capsys.readouterr().out
    assert "16384 devices at 1.973e-05 failures per device-hour" in out
    assert "every 3.09 h" in out
    restart = whole_job_restart(FailureModel(), 16_384)
    groups = replica_groups(FailureModel(), 16_384)
    assert f"whole-job restart {restart.goodput:.4f}".split() == \
        next(line for line in out.splitlines() if line.startswith("whole-job restart "))\
        .split()[:3]
    assert "replica groups (8 x 2048)" in out and f"{groups.goodput:.4f}" in out
    assert groups.goodput > restart.goodput


def test_the_command_json_holds_the_inputs_and_both_strategies(capsys):
    argv = ["--failures", "--world-size", "64", "--ft-replica-groups", "4",
            "--save-time-s", "5", "--json"]
    assert plan_command.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["devices"] == 64 and out["ft_replica_groups"] == 4 and out["save_time_s"] == 5
    assert [s["name"] for s in out["strategies"]] == ["whole-job restart",
                                                      "replica groups (4 x 16)"]


@pytest.mark.parametrize("argv, message", [
    (["--save-time-s", "0"], "--save-time-s must be > 0, got 0.0"),
    (["--failure-rate", "nan"], "--failure-rate must be in [1e-12, 1], got nan"),
    (["--failure-rate", "1e-320"], "--failure-rate must be >= 1e-12, got 1e-320"),
    (["--whole-job-share", "1.5"], "--whole-job-share must be"),
    (["--ft-replica-groups", "1"], "--ft-replica-groups must be"),
    (["--ft-replica-groups", "3"], "must divide --world-size 16"),
    (["--restart-time-s", "-1"], "--restart-time-s must be"),
    (["--world-size", "0"], "--world-size must be in [1, 2^63-1], got 0"),
    (["--model", "debug"], "unrecognized arguments: --model debug"),
    (["--recovery-time-s", "soon"], "invalid float value"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert plan_command.main(["--failures", "--world-size", "16", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and message in err, err
    assert err.count("\n") == 1, err


def test_the_output_shown_in_faults_md_is_the_commands(capsys):
    text = (DOCS / "faults.md").read_text()
    shown = text.split("with the defaults, it prints:\n\n```\n", 1)[1].split("```", 1)[0]
    assert plan_command.main(["--failures", "--world-size", "16384"]) == 0
    assert capsys.readouterr().out == shown


def test_every_setting_is_documented_in_faults_md():
    text = (DOCS / "faults.md").read_text()
    for f in fields(FailureModel):
        assert f"--{f.name.replace('_', '-')}" in text, f.name
