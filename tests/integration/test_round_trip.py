"""Round trip: a run on the embedded corpus, `loom export`, and `loom train --model <export>`
as-is (the tokenizer travels with the weights)."""

from __future__ import annotations

import json

import pytest

from loom.data.tokenizers import SHIPPED_FLAG, load_auto_tokenizer, load_shipped_tokenizer
from loom.hf.export import main as export_main
from tests.harness import run_ranks

pytest.importorskip("transformers")
TINY = ["--seq-len", "32", "--fp32", "--lr", "1e-3"]


def test_exported_folder_trains_as_is(tmp_path, capsys):
    env = {"LOOM_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    job = run_ranks(1, ["-m", "loom", "train", "--model", "debug", *TINY, "--max-steps", "1",
                        "--checkpoint-interval", "1", "--outdir", str(tmp_path / "run")],
                    timeout=600, env=env)
    assert job.ok, job.describe()
    assert export_main([str(tmp_path / "run" / "checkpoints" / "step-1"),
                        str(tmp_path / "hf")]) == 0
    captured = capsys.readouterr()
    assert f"model and tokenizer {SHIPPED_FLAG}" in captured.out and not captured.err

    exported = load_auto_tokenizer(str(tmp_path / "hf"))
    shipped = load_shipped_tokenizer()
    text = ["It is a truth universally acknowledged."]
    assert exported.encode(text) == shipped.encode(text) and exported.size == shipped.size

    job = run_ranks(1, ["-m", "loom", "train", "--model", str(tmp_path / "hf"), *TINY,
                        "--max-steps", "2", "--outdir", str(tmp_path / "again")],
                    timeout=600, env=env)
    assert job.ok, job.describe()
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["model"]["vocab_size"] == shipped.size and config["model"]["n_layers"] == 4
