"""Host hygiene: the garbage collector runs at fixed steps only, copies to CUDA start from
pinned memory (nothing on the CPU), and CUDA's allocator gets expandable segments unless
the user configured it. Checked by the calls made: no accelerator needed."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

import loom.runtime.host_hygiene as hygiene
from loom.runtime.host_hygiene import ScheduledGC, expandable_segments, to_device
from tests.harness import REPO

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
SRC = REPO / "src"


def test_the_collector_is_frozen_off_and_run_every_n_steps(monkeypatch) -> None:
    assert gc.isenabled()
    collector = ScheduledGC(every=3)
    collector.begin()
    try:
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        collected: list[tuple[int, ...]] = []
        monkeypatch.setattr(hygiene.gc, "collect", lambda *a: collected.append(a) or 0)
        for step in range(1, 8):
            collector.after_step(step)
        assert collected == [(1,), (1,)], "steps 3 and 6, the young generations"
    finally:
        monkeypatch.undo()
        collector.finish()
    assert gc.isenabled() and gc.get_freeze_count() == 0


FROZEN_BY_THE_CALLER = """
import gc
from loom.runtime.host_hygiene import ScheduledGC
gc.freeze()
frozen = gc.get_freeze_count()
collector = ScheduledGC(every=3)
collector.begin()
assert not gc.isenabled()
collector.finish()
assert gc.isenabled() and gc.get_freeze_count() == frozen > 0, (gc.get_freeze_count(), frozen)
"""


def test_what_the_caller_froze_stays_frozen() -> None:
    """A process that froze objects before the run (an embedding application, the tests'
    fork server) keeps them frozen after it: only what `begin` froze is unfrozen. In a
    fresh interpreter: in the test process another thread (tqdm's monitor, say) may free
    a frozen object at any moment, and the count moves under the check."""
    done = subprocess.run([sys.executable, "-c", FROZEN_BY_THE_CALLER], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(SRC)})
    assert done.returncode == 0, done.stderr[-2000:]


def test_gc_every_0_leaves_pythons_schedule(monkeypatch) -> None:
    collector = ScheduledGC(every=0)
    collector.begin()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    monkeypatch.setattr(hygiene.gc, "collect", lambda *a: pytest.fail("collected"))
    collector.after_step(50)
    collector.finish()


def recorded_copies(monkeypatch) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, device, non_blocking=False: calls.append(
        f"to {device.type} non_blocking={non_blocking}") or self)
    return calls


def test_a_copy_to_cuda_is_pinned_first_and_queued(monkeypatch) -> None:
    calls = recorded_copies(monkeypatch)
    to_device(torch.ones(2), CUDA)
    assert calls == ["pin", "to cuda non_blocking=True"]


def test_a_copy_on_the_cpu_pins_nothing(monkeypatch) -> None:
    calls = recorded_copies(monkeypatch)
    to_device(torch.ones(2), CPU)
    assert calls == ["to cpu non_blocking=True"]


@pytest.mark.parametrize("device, env, expected", [
    (CUDA, {}, True), (CPU, {}, False),
    (CUDA, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}, False),
    (CUDA, {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, False)])
def test_expandable_segments_only_on_cuda_and_not_over_the_users_settings(
        monkeypatch, device: torch.device, env: dict[str, str], expected: bool) -> None:
    for name in hygiene.ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings: list[str] = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", settings.append)
    assert expandable_segments(device) is expected
    assert settings == (["expandable_segments:True"] if expected else [])
