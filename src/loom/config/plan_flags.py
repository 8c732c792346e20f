"""`loom plan`'s own flags, declared once like the job's (`loom.config.declare.flag`, with
their ranges): its parser, its range checks and the flag reference (docs/flags.md) are
generated from this class. Every other flag of `loom plan` is `loom train`'s."""

from __future__ import annotations

from dataclasses import dataclass, fields

from loom.config.declare import flag
from loom.config.numbers import check_value
from loom.config.parser import add_flags, strict_parser
from loom.errors import ConfigError


@dataclass(frozen=True)
class PlanFlags:
    world_size: int | None = flag(None, "ranks the job would run on, 1 to 2^20 (required)",
                                  type=int, ge=1, le=2**20)
    device_memory: str | None = flag(None, "memory of one device, e.g. 64GiB, 80GB, 512MiB "
                                     "(required)", type=str)
    device: str = flag("cpu", "the device the step time is priced on: cpu (this CPU's "
                       "measured peak) or a name from loom's device table "
                       "(loom/observability/devices.py: H100, H200, B200, A100, L40S, MI300X, "
                       "MI355X, MI250X, Max 1550, ...); another name needs the three figures "
                       "below")
    device_peak_tflops: float | None = flag(
        None, "dense matmul peak of one device, TFLOP/s in (0, 1e5], for every matmul "
        "of the step (replaces the table's)", type=float, gt=0, le=1e5)
    device_bandwidth: float | None = flag(
        None, "what one device sends in one direction in a collective, GB/s in (0, 1e5], "
        "within a node and across (replaces the table's link and network figures)",
        type=float, gt=0, le=1e5)
    device_memory_bandwidth: float | None = flag(
        None, "memory bandwidth of one device, TB/s in (0, 1000] (prices eager pointwise "
        "and float8 cast traffic; replaces the table's)", type=float, gt=0, le=1e3)
    json: bool = flag(False, "print the plan as one JSON object")
    search: bool = flag(False, "search layouts and print the ten fastest that fit")


REQUIRED = ("world_size", "device_memory")


def parse_plan_flags(argv: list[str]) -> tuple[PlanFlags, list[str]]:
    """`loom plan`'s own flags, checked against their ranges, and the rest (`loom train`'s
    flags, parsed by the job's parser)."""
    parser = strict_parser("loom plan")
    add_flags(parser, list(fields(PlanFlags)))
    given, rest = parser.parse_known_args(argv)
    values = vars(given)
    missing = [f"--{name.replace('_', '-')}" for name in REQUIRED if name not in values]
    if missing:
        raise ConfigError(f"the following arguments are required: {', '.join(missing)}")
    options = PlanFlags(**values)
    for f in fields(PlanFlags):
        check_value(f, getattr(options, f.name))
    return options, rest

