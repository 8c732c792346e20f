"""Hang reports name the collective from torch's Flight Recorder entries."""

import time

import torch
import torch.distributed as dist
from torch import nn

from loom.parallel.fsdp import enclosing, unit_names
from loom.runtime import flight
from loom.runtime.flight import describe, enable, group_label, last_collective, newest
from tests.one_rank import one_rank_group


def test_group_labels_name_mesh_dims_and_the_world():
    assert group_label(["3", "mesh_dp_shard"]) == "dp_shard"
    assert group_label(["0", "default_pg"]) == "world"
    assert group_label(["7", "undefined"]) == "group 7"


def test_the_newest_entry_is_the_one_a_blocked_rank_waits_in():
    entries = [{"record_id": 4, "profiling_name": "gloo:all_gather", "collective_seq_id": 12,
                "process_group": ["2", "mesh_dp_shard"]},
               {"record_id": 9, "profiling_name": "gloo:all_reduce", "collective_seq_id": 31,
                "process_group": ["0", "default_pg"]},
               {"record_id": 7, "profiling_name": "gloo:broadcast", "collective_seq_id": 2,
                "process_group": ["1", "mesh_tp"]}]
    assert last_collective({"entries": entries}) == "all_reduce #31 on world"
    assert describe(entries[0]) == "all_gather #12 on dp_shard"
    assert last_collective({}) is None


def test_enabling_keeps_a_users_own_buffer_size():
    env: dict[str, str] = {}
    enable(env)
    assert int(env["TORCH_FR_BUFFER_SIZE"]) > 0
    env = {"TORCH_FR_BUFFER_SIZE": "5000"}
    enable(env)
    assert env["TORCH_FR_BUFFER_SIZE"] == "5000"


def test_a_recorder_entry_is_named_by_the_unit_whose_forward_it_was_entered_in():
    flight._units.clear()
    flight.in_unit("norm, output")
    start = flight._units[-1][0]
    flight.in_unit("layers.3")
    flight.in_unit(None)  # its forward ended: later collectives are no unit's
    ended = flight._units[2][0]
    assert flight.unit_at(start - 1) is None  # older than the hooks' record
    assert flight.unit_at(start) == "norm, output"
    assert flight.unit_at(ended - 1) in ("layers.3", "norm, output")  # same-ns stamps
    assert flight.unit_at(ended) is None
    entry = {"record_id": 1, "profiling_name": "nccl:all_gather", "collective_seq_id": 5,
             "process_group": ["2", "mesh_dp_shard"], "time_created_ns": start}
    assert newest({"entries": [entry]}, None) == "all_gather #5 on dp_shard (norm, output)"
    after = {**entry, "time_created_ns": ended + 1, "profiling_name": "nccl:all_reduce"}
    assert newest({"entries": [after]}, None) == "all_reduce #5 on dp_shard (module unknown)"
    assert newest({}, None) is None


def test_loom_exchanges_name_their_unit_and_count_per_group():
    flight._exchange_seq.clear()
    flight.entered("all_gather", "mesh_dp_shard", "3", "layers.0")
    flight.entered("reduce_scatter", "mesh_dp_shard", "3", "layers.1")
    exchange = flight._exchange[0]
    assert exchange is not None
    assert newest({}, exchange) == "reduce_scatter #2 on dp_shard (layers.1)"
    older = {"record_id": 1, "profiling_name": "gloo:all_reduce", "collective_seq_id": 9,
             "process_group": ["0", "default_pg"], "time_created_ns": exchange[0] - 1}
    assert newest({"entries": [older]}, exchange) == "reduce_scatter #2 on dp_shard (layers.1)"
    newer = {**older, "time_created_ns": exchange[0] + 1}
    assert newest({"entries": [newer]}, exchange).startswith("all_reduce #9 on world (")


def test_units_are_named_from_the_models_own_module_names():
    model = nn.ModuleDict({"embed": nn.Embedding(4, 2), "layers": nn.ModuleList(
        [nn.Linear(2, 2) for _ in range(2)]), "norm": nn.LayerNorm(2), "out": nn.Linear(2, 4)})
    units = [model["embed"], *model["layers"], [model["norm"], model["out"]]]
    names = unit_names(model, units[:3])
    assert [names[id(u)] for u in units[:3]] == ["embed", "layers.0", "layers.1"]
    assert names[id(model)] == "norm, out"  # the root: what no unit holds
    assert unit_names(model, units)[id(units[3])] == "norm, out"
    assert unit_names(model, units)[id(model)] == "root"


def test_a_units_forward_hands_back_to_the_unit_around_it():
    block = nn.ModuleDict({"attn": nn.Linear(2, 2), "experts": nn.Linear(2, 2)})
    model = nn.ModuleDict({"layers": nn.ModuleList([block, nn.Linear(2, 2)]),
                           "norm": nn.LayerNorm(2)})
    units = [block, block["experts"], model["layers"][1], model]
    outer = enclosing(model, units)
    assert [outer[id(u)] for u in units] == [id(model), id(block), id(model), None]


def test_an_fsdp_call_names_the_entries_created_inside_it_even_while_it_blocks():
    flight._units.clear()
    flight._calls.clear()
    flight.in_unit("layers.0")  # a forward under way: the call's own unit wins inside it
    with flight.moving("layers.1"):
        inside = time.time_ns()
        assert flight.unit_at(inside) == "layers.1"  # still under way, as in a hang
    assert flight.unit_at(inside) == "layers.1"
    assert flight.unit_at(time.time_ns()) == "layers.0"


def test_arrival_times_come_from_the_recorders_json_dump(monkeypatch):
    """A one-rank gloo group after three all-reduces: their arrival stamps are read from the
    JSON dump, in order, within the time the collectives ran."""
    monkeypatch.setenv(flight.BUFFER_ENV, "16")
    before = time.time_ns()
    with one_rank_group():
        for _ in range(3):
            dist.all_reduce(torch.ones(2))
        times = flight.arrival_times()
    mine = [t for t in times if t >= before]  # the recorder is per process: earlier
    assert len(mine) == 3 and mine == sorted(mine)  # tests' groups may have left entries
    assert mine[-1] <= time.time_ns()
    assert flight.arrival_times() == []  # no process group, nothing read
