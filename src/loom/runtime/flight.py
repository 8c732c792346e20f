"""The collective a rank last entered, from torch's Flight Recorder, for hang reports.

torch records every collective of every process group (gloo and NCCL alike) in a ring
buffer when `TORCH_FR_BUFFER_SIZE` is set before the process group starts. A rank stuck in
a collective blocks inside it, so its newest entry is the one it waits in: op, the group's
sequence number (equal across the ranks that reached it) and the group. The watchdog reads
it once, when it fires; nothing is read on the training path.

The recorder does not see gloo's point-to-point sends, which make loom's FSDP all-gathers and
reduce-scatters on CPU (`loom.parallel.gloo_comm`): those record themselves here (`entered`),
each with the FSDP unit whose parameters it moves. For the recorder's own entries the unit
is the one whose FSDP collective call was under way when the entry was created (`moving`,
around FSDP's own all-gather and reduce-scatter), else the one whose forward was running
(`in_unit`, set by hooks on each unit: TP, CP and EP collectives inside a block); elsewhere
(the optimizer step, a backward's other collectives) it is said to be unknown rather than
guessed from a stale name.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import deque
from collections.abc import Iterator, MutableMapping
from pathlib import Path

import torch.distributed as dist

try:  # private; present in torch 2.13 (checked), for gloo and NCCL groups alike
    from torch._C._distributed_c10d import _dump_fr_trace_json
except ImportError:  # a build without them: hang reports then name no collective
    _dump_fr_trace_json = None

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
DEFAULT_ENTRIES = 256
"""Enough to show the last steps' collectives; each entry is a few hundred bytes."""


UNKNOWN = "module unknown"

_units: deque[tuple[int, str | None]] = deque(maxlen=64)
"""(time.time_ns(), unit name or None) each time an FSDP unit's forward began or ended: the
recorder stamps its entries with the same clock, so an entry is matched to the unit whose
forward it was entered in, not to whichever unit ran last."""

_exchange: list[tuple[int, str, str | None] | None] = [None]
"""loom's own newest exchange: (time.time_ns(), 'all_gather #12 on dp_shard', unit)."""
_exchange_seq: dict[str, int] = {}
"""Exchanges entered so far per process group: the same count on every rank that reached
the exchange, like the recorder's sequence numbers (but its own count)."""


def in_unit(name: str | None) -> None:
    """An FSDP unit's forward begins (`name`) or ends (None): one tuple appended, no sync."""
    _units.append((time.time_ns(), name))


_calls: deque[list] = deque(maxlen=64)
"""[start, end or None while under way, unit] of FSDP's own collective calls on each unit
(`moving`), whichever pass issued them: backward's reduce-scatters and prefetched
all-gathers too."""


@contextlib.contextmanager
def moving(unit: str) -> Iterator[None]:
    """Around one FSDP collective call of `unit`'s parameters: the recorder's entry for it
    is created inside, so its stamp falls in this span, which is recorded before the call
    (a rank blocked in it never leaves). Two clock reads and a list."""
    span = [time.time_ns(), None, unit]
    _calls.append(span)
    try:
        yield
    finally:
        span[1] = time.time_ns()


def unit_at(time_ns: int) -> str | None:
    """The unit whose parameters a collective entered at `time_ns` moves (an FSDP call's
    span), else the unit whose forward was running then; None outside any or when the
    records no longer reach that far back."""
    for start, end, name in reversed(_calls):
        if start <= time_ns and (end is None or time_ns <= end):
            return name
    for when, name in reversed(_units):
        if when <= time_ns:
            return name
    return None


def entered(op: str, group_desc: str, group_name: str, unit: str | None) -> None:
    """Record one of loom's own exchanges as it is posted (a dict update and a tuple)."""
    label = group_label([group_name, group_desc])
    seq = _exchange_seq[label] = _exchange_seq.get(label, 0) + 1
    _exchange[0] = (time.time_ns(), f"{op} #{seq} on {label}", unit)


_blocked_ns = [0]
"""Time this rank has spent blocked in loom's own exchanges (`blocked`), in ns."""


@contextlib.contextmanager
def blocked() -> Iterator[None]:
    """Count the time spent waiting in an exchange the recorder does not see (gloo's
    point-to-point sends that make loom's FSDP collectives, `loom.parallel.gloo_comm`): a
    straggler's peers wait there, so `loom.runtime.straggler` must count it. Measured where the
    rank waits, not where it posts, because these exchanges are asynchronous."""
    start = time.perf_counter_ns()
    try:
        yield
    finally:
        _blocked_ns[0] += time.perf_counter_ns() - start


def blocked_s() -> float:
    """Seconds spent in `blocked` so far (a running total: callers take differences)."""
    return _blocked_ns[0] / 1e9


def arrival_times() -> list[int]:
    """When this rank entered each collective still in the recorder, in ns since the epoch
    (host-side stamps; nothing is synchronised). Read at logging steps only, from the JSON
    dump: 10 ms for 256 entries on an idle AVX2 EPYC where the pickled one reads in 4 ms, but
    loom reads no pickle, so nothing in a dump could ever run code."""
    return [int(e.get("time_created_ns", 0)) for e in record().get("entries") or []]


def enable(environ: MutableMapping[str, str] = os.environ) -> None:
    """Turn the recorder on (a user's own size wins); must run before the process group."""
    environ.setdefault(BUFFER_ENV, str(DEFAULT_ENTRIES))


def record() -> dict:
    """This rank's recorder contents, {} without a process group or a recorder."""
    if _dump_fr_trace_json is None or not dist.is_initialized():
        return {}
    try:
        return json.loads(_dump_fr_trace_json(includeCollectives=True))
    except Exception:  # the recorder is off (buffer size 0) or its dump failed
        return {}


def group_label(process_group: list[str]) -> str:
    """A mesh dim's name for a DeviceMesh group ('mesh_dp_shard' -> 'dp_shard'), 'world'
    for the default group, else the group's own name."""
    name, desc = ([*process_group, "", ""])[:2]
    if desc == "default_pg":
        return "world"
    if desc.startswith("mesh_"):
        return desc.removeprefix("mesh_")
    return desc if desc and desc != "undefined" else f"group {name}"


def describe(entry: dict) -> str:
    """'all_gather #1559 on dp_shard' for one recorder entry."""
    op = str(entry.get("profiling_name", "?")).split(":")[-1]
    return (f"{op} #{entry.get('collective_seq_id', '?')} on "
            f"{group_label(list(entry.get('process_group', [])))}")


def last_collective(dump: dict) -> str | None:
    """The newest collective in a recorder dump, described; None when it has none."""
    entries = dump.get("entries") or []
    if not entries:
        return None
    return describe(max(entries, key=lambda e: e.get("record_id", 0)))


def newest(dump: dict, exchange: tuple[int, str, str | None] | None) -> str | None:
    """'all_gather #12 on dp_shard (layers.3)': the newer of the recorder's newest entry and
    loom's own newest exchange, with the unit whose parameters it moves; None without
    either."""
    entries = dump.get("entries") or []
    entry = max(entries, key=lambda e: e.get("record_id", 0)) if entries else None
    created = int(entry.get("time_created_ns", 0)) if entry else 0
    if exchange is not None and (entry is None or exchange[0] >= created):
        what, unit = exchange[1], exchange[2]
    elif entry is not None:
        what, unit = describe(entry), unit_at(created)
    else:
        return None
    return f"{what} ({unit or UNKNOWN})"


def waiting_in(outdir: Path, rank: int) -> str | None:
    """For a hang report: the collective this rank last entered and whose parameters it
    moves, with the recorder's whole record written to `<outdir>/collectives-<rank>.json`
    for a closer look."""
    dump = record()
    if dump:
        with contextlib.suppress(OSError):
            (outdir / f"collectives-{rank}.json").write_text(json.dumps(dump, default=str))
    return newest(dump, _exchange[0])
