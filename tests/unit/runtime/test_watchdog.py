"""The watchdog names the silent ranks, with their hosts, from the heartbeats in the store."""

import time
from pathlib import Path

import torch.distributed as dist

from loom.runtime.watchdog import StepWatchdog


def test_silent_ranks_are_named_with_the_host_their_last_heartbeat_gave(tmp_path: Path):
    store = dist.HashStore()
    watchdog = StepWatchdog(1.0, tmp_path, 0, 4, store)
    watchdog.beat(9)
    watchdog.publish()
    old = time.time() - 60
    store.set("heartbeat/1", f"5 {old} host-a")
    store.set("heartbeat/3", f"4 {old}")  # a heartbeat without a host
    assert watchdog.stalled() == [(1, "host-a", "silent since step 5"),
                                  (2, None, "no heartbeat"), (3, None, "silent since step 4")]
