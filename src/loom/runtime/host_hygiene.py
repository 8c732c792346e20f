"""Host-side habits of a host-bound step: Python's garbage collector on a schedule, pinned
host memory for copies to an accelerator, and CUDA's expandable allocator segments.

Python's collector runs whenever allocations pass its thresholds, in the middle of a step,
and then walks every object the setup left (modules, parameters, the dataset's index): a
pause the step cannot hide. After setup those objects are frozen (`gc.freeze`: never
scanned again), automatic collection is off, and a young-generation collection runs every
N steps at a fixed point of the loop, as torchtitan does (`--gc-every`; 0 leaves Python's
own schedule).
"""

from __future__ import annotations

import gc
import os

import torch

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""Where a user sets the allocator's options: they are left alone when either is set."""


class ScheduledGC:
    """Collect at fixed steps only: `begin` after setup, `after_step` each step, `finish`
    when the loop ends (the collector's own schedule comes back).

    Setup's objects are frozen (moved to a generation no collection scans) unless the
    process had frozen objects already (an application embedding `loom.fit`, a fork
    server): Python can only unfreeze everything, so `finish` unfreezes only what `begin`
    froze, and never what the caller did."""

    def __init__(self, every: int):
        self.every = every
        self.was_enabled = gc.isenabled()
        self.froze = False

    def begin(self) -> None:
        if self.every <= 0:
            return
        gc.collect()
        self.froze = gc.get_freeze_count() == 0
        if self.froze:
            gc.freeze()
        gc.disable()

    def after_step(self, step: int) -> None:
        if self.every > 0 and step % self.every == 0:
            gc.collect(1)  # the young generations: what steps allocate and drop

    def finish(self) -> None:
        if self.every <= 0:
            return
        if self.froze:
            gc.unfreeze()
        if self.was_enabled:
            gc.enable()


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` queued for `device` without a host wait: a CPU tensor bound for CUDA is
    pinned first (a copy from pageable memory would be synchronous); on the CPU a no-op."""
    if device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def expandable_segments(device: torch.device) -> bool:
    """Let CUDA's caching allocator grow segments in place (fewer, larger blocks: less
    fragmentation from a step's varying sizes), unless the user configured the allocator.
    Before the first allocation; returns whether it was set."""
    if device.type != "cuda" or any(os.environ.get(v) for v in ALLOC_CONF_VARS):
        return False
    # torch 2.13's setter (torch.cuda.memory._set_allocator_settings is its deprecated alias)
    torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
    return True
