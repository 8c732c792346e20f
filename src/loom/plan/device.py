"""The device a plan prices a step on: a record of loom's table
(`loom.observability.devices`), the user's own figures, or the CPU (peak measured). Never
a guess: a device the table does not know is refused unless its figures are given."""

from __future__ import annotations

from dataclasses import replace

from loom.errors import ConfigError
from loom.observability.devices import CPU, DEVICES, Device, known_device

PlanDevice = str | Device
"""`--device` as the plan functions take it: a name from the table (or "cpu"), or a record
built from the user's figures (`plan_device`)."""

CUSTOM_FLAGS = ("--device-peak-tflops", "--device-bandwidth", "--device-memory-bandwidth")


def figures(device: PlanDevice) -> Device:
    """The record of `device`; one line naming the table for a name it does not hold."""
    if isinstance(device, Device):
        return device
    known = known_device(device)
    if known is None:
        raise ConfigError(f"--device {device!r} is not in loom's device table (cpu, "
                          f"{', '.join(d.name for d in DEVICES)}); give its figures with "
                          f"{', '.join(CUSTOM_FLAGS)}")
    return known


def plan_device(name: str, peak_tflops: float | None, bandwidth_gbs: float | None,
                memory_tbs: float | None) -> PlanDevice:
    """`--device NAME` with the figures the user gave: each replaces the table's (the peak
    for every matmul dtype, the bandwidth for every collective, within a node or across);
    a device the table does not know needs all three."""
    given = (peak_tflops, bandwidth_gbs, memory_tbs)
    if all(v is None for v in given):
        figures(name)  # refused here, before any tracing, when the table does not know it
        return name
    known = known_device(name)
    if known is CPU:
        raise ConfigError(f"{'/'.join(CUSTOM_FLAGS)} describe an accelerator; --device cpu "
                          "measures this CPU's peak (name the accelerator with --device)")
    if known is None and None in given:
        missing = [flag for flag, v in zip(CUSTOM_FLAGS, given, strict=True) if v is None]
        raise ConfigError(f"--device {name!r} is not in loom's device table: give "
                          f"{' and '.join(missing)} too (every figure of a step's time)")
    base = known or Device(name, {}, None, None, 0.0, 0.0, 1, "")
    if peak_tflops is not None:
        base = replace(base, tflops={"bf16": peak_tflops, "fp32": peak_tflops})
    if bandwidth_gbs is not None:
        base = replace(base, link_gbs=bandwidth_gbs, network_gbs=bandwidth_gbs)
    if memory_tbs is not None:
        base = replace(base, hbm_tbs=memory_tbs)
    named = ", ".join(flag for flag, v in zip(CUSTOM_FLAGS, given, strict=True) if v is not None)
    return replace(base, source=f"{base.source}; {name} as given by {named}".lstrip("; "))
