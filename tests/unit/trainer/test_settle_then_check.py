"""Settle, then check, once (issue #65): a fact start-up learns (chat data turning the
document mask on, a Hugging Face folder's shape) reaches the one validation, so it can
neither bypass a refusal nor trip one meant for another shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loom.cli import run_train
from loom.config import parse_args
from loom.config.validate import validate
from loom.parallel.mesh import ParallelDims
from loom.trainer.resolve import resolve_model
from tests.unit.test_bad_input import assert_one_line_exit_2

pytestmark = pytest.mark.usefixtures("loom_logger_restored")


def write_chat(path: Path) -> None:
    with path.open("w") as f:
        for i in range(12):
            f.write(json.dumps({"prompt": f"What is {i} + {i}?", "completion": f"{2 * i}."})
                    + "\n")


def test_chat_data_with_mtp_is_refused_in_one_line_or_trains(tmp_path, capsys):
    """Chat data turns --doc-mask on after the flags are parsed; the MTP + doc-mask refusal
    must see it. Until MTP composes with the mask the run is refused in one line (exit 2,
    nothing written); once it does, the run trains: either way, never a traceback (this
    test holds under `python -O`, where the model's old assert vanished and the mask was
    silently dropped)."""
    data = tmp_path / "chat.jsonl"
    write_chat(data)
    outdir = tmp_path / "run"
    code = run_train(["--model", "deepseek-v3-mtp-debug", "--dataset", str(data), "--fp32",
                      "--seq-len", "32", "--max-steps", "1", "--outdir", str(outdir)])
    err = capsys.readouterr().err
    if code == 0:
        config = json.loads((outdir / "config.json").read_text())
        assert config["data"]["doc_mask"] is True, config["data"]
        return
    assert_one_line_exit_2(code, err, "--doc-mask")
    assert not outdir.exists() or not any(outdir.iterdir()), list(outdir.iterdir())


def test_native_deepseek_folder_takes_ep_at_parse_and_after_its_shape_is_read(tmp_path):
    """`--model-impl native` on a transformers-built DeepseekV3 folder with --ep 2: the
    flags' defaults (a dense shape) are not the folder's, so the expert checks wait for
    the folder's shape (they refused --ep 2 before), and then pass on it."""
    from tests.deepseek_folders import save_deepseek

    folder = save_deepseek(tmp_path / "ds", tokenizer=False)
    for impl in ("native", "auto"):
        cfg = parse_args(["--model", str(folder), "--model-impl", impl, "--ep", "2",
                          "--seq-len", "32"])
        cfg = resolve_model(cfg)
        assert cfg.model.family == "deepseek-v3", cfg.model
        ParallelDims.from_config(cfg.parallel, 2)
        validate(cfg)  # what resolve checks, the folder's experts in
