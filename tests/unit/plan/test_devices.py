"""`loom plan` prices a step from the device's own record (loom.observability.devices) and
from nothing else: every record's peak, link and network figures move its plan, an unknown
device is one line (exit 2), and a device described by flags is planned from them."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from loom.config import parse_args
from loom.config.resolved import settled
from loom.losses import loss_impl_for
from loom.observability import devices
from loom.observability.devices import DEVICES, Device
from loom.plan import command
from loom.plan.device import CUSTOM_FLAGS, plan_device
from loom.plan.speed import EFFICIENCY, _flops, predict_step_time
from loom.plan.trace import fake_world

SMALL = ["--dim", "256", "--n-layers", "2", "--n-heads", "16", "--n-kv-heads", "16",
         "--vocab-size", "1024", "--seq-len", "128", "--batch-size", "2", "--dtype", "bf16",
         "--compile"]  # compiled: no eager pointwise traffic, the matmuls alone set compute


def step(argv: list[str], world: int, device: str | Device, tmp_path: Path):
    cfg = parse_args([*SMALL, *argv])
    cfg = settled(cfg, loss_impl=loss_impl_for(cfg))
    with fake_world(world):
        return cfg, predict_step_time(cfg, world, device, tmp_path)


def with_record(monkeypatch: pytest.MonkeyPatch, name: str, **figures: object) -> None:
    """The table with one record's figures changed."""
    monkeypatch.setattr(devices, "DEVICES", tuple(
        replace(d, **figures) if d.name == name else d for d in DEVICES))


@pytest.mark.parametrize("record", DEVICES, ids=[d.name for d in DEVICES])
def test_each_device_is_planned_from_its_own_figures(record, monkeypatch, tmp_path):
    """Compute is the counted FLOPs over the record's own peak; the tp collectives within a
    node travel at its link, across nodes at its network: halving each moves the plan."""
    cfg, base = step([], 1, record.name, tmp_path)
    assert base.compute_s == pytest.approx(
        _flops(cfg) / (record.peak(torch.bfloat16) * EFFICIENCY))
    within = ["--tp", "2"]
    across = ["--tp", "16"]  # past every record's node
    before = [step(flags, world, record.name, tmp_path)[1] for flags, world in
              ((within, 2), (across, 16))]
    with_record(monkeypatch, record.name, tflops={k: 2 * v for k, v in record.tflops.items()})
    assert step([], 1, record.name, tmp_path)[1].compute_s == pytest.approx(base.compute_s / 2)
    monkeypatch.undo()
    with_record(monkeypatch, record.name, link_gbs=record.link_gbs / 2)
    slower_link = step(within, 2, record.name, tmp_path)[1]
    assert slower_link.exposed_comm_s == pytest.approx(2 * before[0].exposed_comm_s)
    assert step(across, 16, record.name, tmp_path)[1].seconds == before[1].seconds
    monkeypatch.undo()
    with_record(monkeypatch, record.name, network_gbs=record.network_gbs / 2)
    assert step(across, 16, record.name, tmp_path)[1].exposed_comm_s == pytest.approx(
        2 * before[1].exposed_comm_s)
    assert step(within, 2, record.name, tmp_path)[1].seconds == before[0].seconds


def test_every_record_names_its_figures_and_their_source():
    for d in DEVICES:
        assert d.tflops.keys() == {"bf16", "fp32"} and d.hbm_tbs and d.link_gbs > 0, d
        assert d.network_gbs > 0 and d.node_size >= 1 and len(d.source) > 40, d
    names = [d.name.lower() for d in DEVICES]
    for i, name in enumerate(names):  # a shorter name listed first would shadow this one
        assert not any(earlier in name for earlier in names[:i]), name


def test_an_unknown_device_is_one_line_and_exit_2(capsys):
    argv = ["--model", "debug", "--world-size", "2", "--device-memory", "1GiB",
            "--device", "Some Future Accelerator"]
    assert command.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Some Future Accelerator" in err
    assert "--device-peak-tflops" in err and "--device-bandwidth" in err
    assert command.main([*argv, "--device-peak-tflops", "100"]) == 2
    assert "--device-bandwidth and --device-memory-bandwidth" in capsys.readouterr().err


H100 = next(d for d in DEVICES if d.name == "H100")
H100_FIGURES = (H100.tflops["bf16"], H100.link_gbs, H100.hbm_tbs)


def test_a_device_given_by_its_figures_is_planned_from_them(tmp_path):
    """An unknown name with H100's figures (within a node) plans H100's step; with half the
    peak, the compute doubles; a known name's figure given replaces the table's."""
    given = plan_device("My Accelerator", *H100_FIGURES)
    for flags, world in (([], 1), (["--tp", "2"], 2)):
        mine, h100 = (step(flags, world, d, tmp_path)[1] for d in (given, "H100"))
        assert (mine.compute_s, mine.exposed_comm_s) == (h100.compute_s, h100.exposed_comm_s)
    half = plan_device("Mine", H100_FIGURES[0] / 2, *H100_FIGURES[1:])
    assert step([], 1, half, tmp_path)[1].compute_s == pytest.approx(
        2 * step([], 1, given, tmp_path)[1].compute_s)
    slower = plan_device("H100", None, H100.link_gbs / 4, None)
    assert step(["--tp", "2"], 2, slower, tmp_path)[1].exposed_comm_s == pytest.approx(
        4 * step(["--tp", "2"], 2, "H100", tmp_path)[1].exposed_comm_s)


@pytest.mark.slow
def test_loom_plan_takes_a_device_by_its_figures(capsys, tmp_path):
    """The command line: one traced plan (~40 s on a loaded 2-core machine)."""
    base = ["--model", "debug", "--world-size", "1", "--device-memory", "8GiB", "--json",
            "--seq-len", "64"]
    flags = itertools.chain(*zip(CUSTOM_FLAGS, map(str, H100_FIGURES), strict=True))
    assert command.main([*base, "--device", "My Accelerator", *flags]) == 0, \
        capsys.readouterr().err
    given = json.loads(capsys.readouterr().out)
    cfg = parse_args(["--model", "debug", "--seq-len", "64", "--dtype", "bf16"])
    cfg = settled(cfg, loss_impl=loss_impl_for(cfg))
    with fake_world(1):
        known = predict_step_time(cfg, 1, "H100", tmp_path)
    assert given["step_time_s"] == pytest.approx(known.seconds)


@pytest.mark.parametrize(("flags", "says"), [
    (["--device", "cpu", "--device-peak-tflops", "10"], "describe an accelerator"),
    (["--device", "H100", "--device-bandwidth", "0"], "--device-bandwidth must be > 0"),
    (["--device", "Mine", "--device-peak-tflops", "1", "--device-bandwidth", "1",
      "--device-memory-bandwidth", "1", "--dtype", "bf16", "--float8", "tensorwise"],
     "no float8 peak"),
])
def test_figures_that_cannot_apply_are_refused(flags, says, capsys):
    argv = ["--model", "debug", "--world-size", "2", "--device-memory", "1GiB", *flags]
    assert command.main(argv) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "says"), [
    (["--model", "debug", "--device-memory", "1GiB"], "required: --world-size"),
    (["--model", "debug", "--world-size", "0", "--device-memory", "1GiB"],
     "--world-size must be >= 1"),
    (["--world-size", "2", "--device-memory", "1GiB", "--device-memory-bandwidth", "nan"],
     "--device-memory-bandwidth must be"),
])
def test_plan_flags_are_checked_against_their_declared_ranges(argv, says, capsys):
    assert command.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and err.count("\n") == 0, err
