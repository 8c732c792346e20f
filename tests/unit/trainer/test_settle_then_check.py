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


def test_a_shape_flag_given_with_a_hub_folder_agrees_or_is_refused(tmp_path):
    """A Hub folder fixes the model's shape: a shape flag given with it that says the same
    is fine; one that differs is one line, never silently replaced by the folder's
    (transformers' module takes no shape flag at all: refused as unused)."""
    import transformers

    from loom.config.resolved import settled
    from loom.errors import ConfigError
    from loom.hf.model_config import hf_model_shape
    from tests.hf_models import save_model

    folder = save_model(tmp_path / "llama", transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64), 0, False)

    def resolved(*flags: str, impl: str = "native"):
        cfg = resolve_model(parse_args(["--model", str(folder), "--model-impl", impl,
                                        "--seq-len", "32", *flags]))
        return settled(cfg, **hf_model_shape(cfg, 0))

    assert resolved("--dim", "32").model.dim == 32
    for flags, name in ((["--dim", "64"], "--dim"), (["--n-layers", "3"], "--n-layers")):
        with pytest.raises(ConfigError, match=f"^{name} .*fixes it at .*; drop {name}$"):
            resolved(*flags)
    with pytest.raises(ConfigError, match="^--dim is not used by the transformers family"):
        resolved("--dim", "64", impl="transformers")
