"""A MoE run's checkpoint records the MoE arguments, and `loom export` of loom's
DeepSeek-style MoE refuses in one line (exit 2) naming the feature Qwen3-MoE, the one
Hugging Face architecture of loom's MoE, does not have."""

from __future__ import annotations

import json

from loom.hf.export import main as export_main
from tests.harness import run_ranks


def test_moe_checkpoint_records_its_arguments_and_export_names_what_it_lacks(tmp_path, capsys):
    job = run_ranks(1, ["-m", "loom", "train", "--model", "moe-debug", "--dataset", "random",
                        "--seq-len", "32", "--fp32", "--max-steps", "1",
                        "--checkpoint-interval", "1", "--outdir", str(tmp_path / "run")],
                    timeout=600)
    assert job.ok, job.describe()
    step = tmp_path / "run" / "checkpoints" / "step-1"
    loop = json.loads((step / "loop.json").read_text())
    config = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    moe = {"n_experts", "top_k", "n_shared_experts", "moe_hidden_dim", "n_dense_layers",
           "score_func", "route_norm", "route_scale", "load_balance_coeff", "aux_loss_coeff"}
    recorded = {k: loop["model_args"].get(k) for k in moe}
    assert recorded == {k: config[k] for k in moe}, (recorded, config)
    assert loop["architecture"]["family"] == "moe", loop["architecture"]

    assert export_main([str(step), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Qwen3MoeForCausalLM: shared experts" in err[0], err
    assert "nothing was written" in err[0], err
    assert not (tmp_path / "hf").exists()
