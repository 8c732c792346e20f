"""`loom plan` of the layout DeepSeek-V3's seed change trains (SimpleFSDP + expert
parallel, issue #57): planned as FSDP2, whose shards SimpleFSDP keeps alike, and said so."""

import json

from loom.plan import command as plan_command

SEED = ["--model", "deepseek-v3-debug", "--dtype", "bf16", "--seq-len", "64",
        "--world-size", "4", "--ep", "2", "--device", "H100", "--device-memory", "80GiB",
        "--json"]


def test_the_seed_layout_plans_as_fsdp2_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    plans = {}
    for dp in ("fsdp2", "simple-fsdp"):
        code = plan_command.main([*SEED, "--data-parallel", dp, "--cache-dir", str(tmp_path)])
        out, err = capsys.readouterr()
        assert code == 0, err
        plans[dp] = (json.loads(out), err)
    (simple, said), (fsdp2, _) = plans["simple-fsdp"], plans["fsdp2"]
    assert "traces --data-parallel simple-fsdp as FSDP2" in said, said
    assert simple["fits"] and simple["layout"]["ep"] == 2, simple
    assert simple["peak_gib"] == fsdp2["peak_gib"] > 0
    assert simple["step_time_s"] == fsdp2["step_time_s"] > 0
