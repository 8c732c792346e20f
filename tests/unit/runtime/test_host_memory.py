"""`--host-memory retain`: after `retain_freed_memory`, the pages of a step's large freed
tensors are reused by the next step instead of being unmapped and faulted in again (counted
as minor page faults once the heap has grown, in a fresh process: malloc's settings are
process-wide)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loom.runtime.host_memory import glibc

COUNT_FAULTS = """
import resource, sys, torch
from loom.runtime.host_memory import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
def step():  # a 64 MiB and a 32 MiB transient, touched and freed, as a training step's
    torch.empty(16 * 2**20).fill_(1.0) + torch.empty(8 * 2**20).fill_(2.0).sum()
for _ in range(10):  # the heap grows to a steady size first
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", COUNT_FAULTS, mode], capture_output=True,
                         text=True, timeout=120, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(glibc() is None, reason="mallopt is glibc's; elsewhere nothing changes")
def test_retained_memory_is_reused_without_page_faults() -> None:
    release, retain = faults("release"), faults("retain")
    assert release >= 5 * 16, f"default malloc faulted only {release} pages in 5 steps"
    # a margin: the kernel may still reclaim an idle block of the retained heap now and then
    assert retain * 5 < release, f"retain: {retain} page faults, release: {release}"
