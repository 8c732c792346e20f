"""The Flight Recorder's dump reader builds plain data from pickle opcodes and never calls
anything: every protocol's plain values come back as `pickle.loads` gives them, and every
way a pickle names or calls code is refused, as is malformed input."""

from __future__ import annotations

import os
import pickle
import pickletools

import pytest
import torch
import torch.distributed as dist

from loom.runtime import flight
from loom.runtime.plain_pickle import NotPlainData, loads

SHARED = [1, 2]
PLAIN = {
    "entries": [{"seq_id": 3, "profiling_name": "gloo:all_gather", "time_created_ns": 2**62,
                 "process_group": ("0", "default_pg"), "input_sizes": [[4, 8]]}],
    "version": "2.10", "ints": [0, -1, 255, 256, 65535, 65536, -2**31, 2**31, 2**70, -2**70],
    "floats": [0.0, -1.5, 1e300, float("inf")], "flags": [True, False, None],
    "text": "ünïcode ✓", "empty": [(), [], {}], "shared": [SHARED, SHARED],
    "tuples": [(1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)],
}
"""What torch's dump holds (it pickles at protocol 2); bytes have opcodes of their own from
protocol 3 and sets from 4 (earlier ones rebuild them by calling a global: refused)."""
SINCE = {3: {"bytes": b"\x00\xff"}, 4: {"sets": [{1, 2}, frozenset({"a"}), set()]}}


def plain(protocol: int) -> dict:
    extra = {k: v for since, more in SINCE.items() if protocol >= since for k, v in more.items()}
    return {**PLAIN, **extra}


class Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_plain_values_come_back_as_pickle_gives_them(protocol: int) -> None:
    data = pickle.dumps(plain(protocol), protocol=protocol)
    value = loads(data)
    assert value == pickle.loads(data) == plain(protocol)
    assert value["shared"][0] is value["shared"][1]  # the memo keeps shared objects shared


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("hostile", [os.system, Payload(), b"bytes", {1}],
                         ids=["a function", "a reduce to os.system", "bytes", "a set"])
def test_anything_that_names_or_calls_code_is_refused(protocol: int, hostile: object) -> None:
    """Plain values that a protocol can only rebuild by calling a global are refused too."""
    data = pickle.dumps({"entries": [hostile]}, protocol=protocol)
    opcodes = {op.name for op, _, _ in pickletools.genops(data)}
    if not opcodes & {"GLOBAL", "STACK_GLOBAL", "REDUCE"}:
        assert loads(data) == pickle.loads(data)  # bytes or a set this protocol holds plainly
        assert not callable(hostile) and not isinstance(hostile, Payload)
        return
    with pytest.raises(NotPlainData, match="refused opcode (GLOBAL|STACK_GLOBAL|REDUCE)"):
        loads(data)


@pytest.mark.parametrize("opcodes", [
    pickle.PROTO + b"\x05" + pickle.NEXT_BUFFER + pickle.STOP,
    pickle.PROTO + b"\x02" + b"X\x01\x00\x00\x00a" + pickle.BINPERSID + pickle.STOP,
    pickle.PROTO + b"\x02" + pickle.EXT1 + b"\x01" + pickle.STOP,
    pickle.PROTO + b"\x02" + pickle.MARK + pickle.INST + b"os\nsystem\n" + pickle.STOP,
], ids=["out-of-band-buffer", "persistent-id", "extension-code", "inst"])
def test_opcodes_that_reach_outside_the_bytes_are_refused(opcodes: bytes) -> None:
    with pytest.raises(NotPlainData, match="refused opcode"):
        loads(opcodes)


@pytest.mark.parametrize("data", [
    b"", b"\x80\x02}q\x00", b"\x80\x02e.", b"\x80\x02(.", b"\x80\x02]q\x00K\x01s.",
    b"\x80\x02h\x07.", b"\x80\x02K\x01K\x02.",
], ids=["empty", "no-stop", "append-to-nothing", "a-mark-as-the-value",
        "setitem-on-a-list", "memo-miss", "two-values-left"])
def test_malformed_pickles_are_refused(data: bytes) -> None:
    with pytest.raises(NotPlainData):
        loads(data)


def test_the_recorders_own_dump_reads_as_plain_data(monkeypatch) -> None:
    """The real dump of a one-rank gloo group, after one all-reduce: the reader gives what
    `pickle.loads` gives, and the arrival times of its entries come from it."""
    if flight._dump_fr_trace is None:
        pytest.skip("this torch build has no Flight Recorder dump")
    monkeypatch.setenv(flight.BUFFER_ENV, "16")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(2))
        data = flight._dump_fr_trace(includeCollectives=True, includeStackTraces=False)
        times = flight.arrival_times()
    finally:
        dist.destroy_process_group()
    assert loads(data) == pickle.loads(data)
    assert times and all(t > 0 for t in times)
