"""`loom plan --failures`: what device failures cost a job at scale, under whole-job restart
from a checkpoint and under fault-tolerant replica groups, and the checkpoint interval that
maximises each. The model, its assumptions and its sources are docs/faults.md.

Failures are a Poisson process: each device fails at `failure_rate` per hour, independently,
so a job of N devices fails at N times that rate and its mean time between failures is
M = 1 / (N rate). Goodput is the expected fraction of wall-clock time spent on steps that
are kept.

Whole-job restart (Daly 2006, who extends Young 1974): the job computes for tau seconds,
saves for delta, and on a failure loses the work since the last save and spends R
restarting (failures may strike during saves and restarts too). The expected wall-clock
time of one tau of work is M e^(R/M) (e^((tau + delta)/M) - 1), so

    goodput(tau) = tau / (M e^(R/M) (e^((tau + delta)/M) - 1)).

Its maximum over tau does not depend on R: setting the derivative to zero gives
ln(1 - u) + u + delta/M = 0 for u = tau/M, solved here by bisection (exact, no series);
Young's sqrt(2 delta M) and Daly's higher-order estimate are its approximations, printed
beside it.

Replica groups: the job is G groups of N/G devices. A failure a group contains costs the
job that group's share (1/G) for the group's recovery time and every group the stall (the
step the failure interrupted and the timeout before the survivors see it). A share of the
failures (`whole_job_share`: a bug every group hits, the coordinator's host, a shared
switch) still stops every group; those follow the restart model above at their own, lower
rate, which sets this layout's checkpoint interval.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

from loom.config.declare import COUNT_MAX, FOREVER_S, INT64_MAX, flag
from loom.config.numbers import check_value
from loom.config.parser import add_flags
from loom.errors import ConfigError

LLAMA3_UNEXPECTED_INTERRUPTIONS = 419
LLAMA3_HOURS = 54 * 24
LLAMA3_DEVICES = 16_384
LLAMA3_RATE = LLAMA3_UNEXPECTED_INTERRUPTIONS / (LLAMA3_DEVICES * LLAMA3_HOURS)
"""Failures per device-hour in Llama 3's pre-training (paper section 3.3.4): 419 unexpected
interruptions in a 54-day snapshot on 16,384 H100s, 1.973e-5 (a device fails every 5.8
years; the job every 3.09 hours)."""


@dataclass(frozen=True)
class FailureModel:
    """The settings of `loom plan --failures`, each a flag: the parser, the range checks and
    `--help` are generated from these declarations."""

    failure_rate: float = flag(
        LLAMA3_RATE, "failures per device-hour (default: Llama 3's 419 unexpected "
        "interruptions in 54 days on 16,384 GPUs)", ge=1e-12, le=1)
    checkpoint_interval_s: float = flag(
        1800.0, "seconds of training between two checkpoint saves", gt=0, le=FOREVER_S)
    save_time_s: float = flag(30.0, "seconds a checkpoint save stops training", gt=0,
                              le=FOREVER_S)
    restart_time_s: float = flag(
        300.0, "seconds from a whole-job failure to training again (detection, "
        "rescheduling, start-up, checkpoint load)", le=FOREVER_S)
    ft_replica_groups: int = flag(8, "fault-tolerant replica groups the devices form",
                                  ge=2, le=COUNT_MAX)
    recovery_time_s: float = flag(
        180.0, "seconds a failed replica group is away (restart, live recovery from a "
        "healthy group)", le=FOREVER_S)
    ft_stall_s: float = flag(
        60.0, "seconds every group loses to a contained failure (the interrupted step and "
        "the timeout before the others go on; torchft's default timeout is 60 s)",
        le=FOREVER_S)
    whole_job_share: float = flag(
        0.1, "share of failures that stop every replica group (assumed)", le=1)


@dataclass(frozen=True)
class Strategy:
    """One way of surviving failures, priced."""

    name: str
    goodput: float
    """At the given checkpoint interval."""
    best_interval_s: float | None
    """The interval that maximises goodput; None when no failure needs a checkpoint."""
    best_goodput: float


def goodput(interval: float, save: float, restart: float, mtbf: float) -> float:
    """Daly's expected goodput of checkpoint/restart (module docstring), in logarithms so
    that a job failing far more often than it saves gives 0, not an overflow."""
    if math.isinf(mtbf):
        return interval / (interval + save)
    x = (interval + save) / mtbf
    log_expm1 = x + math.log(-math.expm1(-x))  # log(e^x - 1), finite for any x > 0
    return math.exp(math.log(interval / mtbf) - restart / mtbf - log_expm1)


def best_interval(save: float, mtbf: float) -> float | None:
    """The tau maximising `goodput`: the root u in (0, 1) of g(u) = ln(1 - u) + u + save/M,
    which falls from save/M to minus infinity, found by bisection; None for an infinite M.
    Since ln(1 - u) + u <= -u^2/2, g is <= 0 at Young's u = sqrt(2 save/M) (so Young's
    interval is an upper bound), and >= u^2 > 0 at half of it: the root is bracketed within
    a factor of 2, and 200 halvings reach the float's last bit at any scale."""
    if math.isinf(mtbf):
        return None
    d = save / mtbf
    hi = min(1.0, math.sqrt(2 * d))
    lo = hi / 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):  # converged to the float's last bit
            break
        if math.log1p(-mid) + mid + d > 0:
            lo = mid
        else:
            hi = mid
    return lo * mtbf


def young_interval(save: float, mtbf: float) -> float:
    """Young's first-order optimum, sqrt(2 delta M)."""
    return math.sqrt(2 * save * mtbf)


def daly_interval(save: float, mtbf: float) -> float:
    """Daly's higher-order estimate (his eq. for delta < 2M; M beyond)."""
    if save >= 2 * mtbf:
        return mtbf
    r = save / (2 * mtbf)
    return math.sqrt(2 * save * mtbf) * (1 + math.sqrt(r) / 3 + r / 9) - save


def mtbf_s(rate_per_s: float) -> float:
    return math.inf if rate_per_s == 0 else 1 / rate_per_s


def best_goodput(best: float | None, m: FailureModel, mtbf: float) -> float:
    """Goodput at the best interval; 1 where no interval is best (saves ever rarer)."""
    return 1.0 if best is None else goodput(best, m.save_time_s, m.restart_time_s, mtbf)


def whole_job_restart(m: FailureModel, devices: int) -> Strategy:
    mtbf = mtbf_s(devices * m.failure_rate / 3600)
    best = best_interval(m.save_time_s, mtbf)
    return Strategy("whole-job restart",
                    goodput(m.checkpoint_interval_s, m.save_time_s, m.restart_time_s, mtbf),
                    best, best_goodput(best, m, mtbf))


def replica_groups(m: FailureModel, devices: int) -> Strategy:
    """Contained failures remove a fixed cost each (first order: outages assumed not to
    overlap); whole-job ones follow the restart model at their own rate."""
    rate = devices * m.failure_rate / 3600
    contained = (1 - m.whole_job_share) * rate * (
        m.recovery_time_s / m.ft_replica_groups + m.ft_stall_s)
    kept = max(0.0, 1 - contained)
    mtbf = mtbf_s(m.whole_job_share * rate)
    best = best_interval(m.save_time_s, mtbf)
    at = goodput(m.checkpoint_interval_s, m.save_time_s, m.restart_time_s, mtbf) * kept
    return Strategy(f"replica groups ({m.ft_replica_groups} x "
                    f"{devices // m.ft_replica_groups})", at, best,
                    best_goodput(best, m, mtbf) * kept)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def failures_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="loom plan --failures", argument_default=argparse.SUPPRESS,
                     description="expected goodput of whole-job restart and of "
                     "fault-tolerant replica groups (docs/faults.md)")
    parser.add_argument("--failures", action="store_true")
    parser.add_argument("--world-size", type=int, required=True, help="devices in the job")
    parser.add_argument("--json", action="store_true")
    add_flags(parser.add_argument_group("failure model"), list(fields(FailureModel)))
    return parser


def parse_failures(argv: Sequence[str]) -> tuple[FailureModel, int, bool]:
    """(the model, the device count, --json); every number checked against its range."""
    given = vars(failures_parser().parse_args(list(argv)))
    devices, as_json = given.pop("world_size"), given.pop("json", False)
    given.pop("failures")
    if not 1 <= devices <= INT64_MAX:
        raise ConfigError(f"--world-size must be in [1, 2^63-1], got {devices}")
    model = FailureModel(**given)
    for f in fields(model):
        check_value(f, getattr(model, f.name))
    if devices % model.ft_replica_groups:
        raise ConfigError(f"--ft-replica-groups {model.ft_replica_groups} must divide "
                          f"--world-size {devices} (groups of equal size)")
    return model, devices, as_json


def report(m: FailureModel, devices: int, strategies: list[Strategy]) -> str:
    mtbf = 3600 / (devices * m.failure_rate)
    lines = [f"loom plan --failures: {devices} devices at {m.failure_rate:.4g} failures per "
             f"device-hour: the job fails every {mtbf / 3600:.3g} h ({mtbf:,.0f} s)",
             f"checkpoint every {m.checkpoint_interval_s:g} s, save {m.save_time_s:g} s, "
             f"restart {m.restart_time_s:g} s; groups recover in {m.recovery_time_s:g} s, "
             f"stall {m.ft_stall_s:g} s, {m.whole_job_share:g} of failures stop every group",
             f"{'':<30}{'goodput':>9}{'best interval':>15}{'goodput there':>15}"]
    for s in strategies:
        best = "none" if s.best_interval_s is None else f"{s.best_interval_s:,.0f} s"
        lines.append(f"{s.name:<30}{s.goodput:>9.4f}{best:>15}{s.best_goodput:>15.4f}")
    lines.append(f"whole-job restart's best interval, approximated: Young "
                 f"{young_interval(m.save_time_s, mtbf):,.0f} s, Daly "
                 f"{daly_interval(m.save_time_s, mtbf):,.0f} s")
    return "\n".join(lines)


def failures_main(argv: Sequence[str]) -> int:
    """Exit 0 with the comparison on stdout, 2 on bad input."""
    try:
        model, devices, as_json = parse_failures(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    strategies = [whole_job_restart(model, devices), replica_groups(model, devices)]
    if as_json:
        print(json.dumps({"devices": devices, **asdict(model),
                          "strategies": [asdict(s) for s in strategies]}))
    else:
        print(report(model, devices, strategies))
    return 0
