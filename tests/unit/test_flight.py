"""Hang reports name the collective from torch's Flight Recorder entries."""

from loom.flight import describe, enable, group_label, last_collective


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
