"""`--model-impl auto` picks a path that works: a Llama folder with biases, gelu or linear
RoPE scaling, and a Qwen3 folder with sliding-window attention (features loom's families do
not have) train through transformers' module, at dp 2 with the single process's losses,
and config.json records why; `native` keeps refusing them, and `auto` with flags only a
native family runs (--tp 2) refuses in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from loom.cli import run_train
from loom.config import ConfigError, parse_args
from loom.trainer.resolve import resolve_model
from tests.compare import losses
from tests.harness import run_ranks
from tests.hf_crafted import edit_config
from tests.hf_models import save_tiny_model

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("loom_logger_restored")

LOSS_RTOL = 1e-5
FEATURES = {  # id: (base architecture, config.json change, words of the recorded reason)
    "attention-bias": ("llama", {"attention_bias": True}, "attention_bias = True"),
    "mlp-bias": ("llama", {"mlp_bias": True}, "mlp_bias = True"),
    "gelu": ("llama", {"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    "rope-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4,
                                                  "factor": 2.0}}, "RoPE scaling 'linear'"),
    "sliding-window": ("qwen3", {"use_sliding_window": True, "sliding_window": 16,
                                 "max_window_layers": 1}, "use_sliding_window = True"),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    return {arch: save_tiny_model(root / arch, arch, tokenizer=False)
            for arch in ("llama", "qwen3")}


def featured(bases: dict[str, Path], tmp_path: Path, feature: str) -> Path:
    arch, change, _ = FEATURES[feature]
    folder = tmp_path / feature
    shutil.copytree(bases[arch], folder)
    edit_config(**change)(folder)
    return folder


@pytest.mark.parametrize("feature", list(FEATURES))
def test_auto_takes_transformers_and_says_why(bases, tmp_path, feature) -> None:
    folder = featured(bases, tmp_path, feature)
    cfg = resolve_model(parse_args(["--model", str(folder), "--seq-len", "16"]))
    assert cfg.model.model_impl == "transformers"
    assert FEATURES[feature][2] in cfg.model.model_impl_reason, cfg.model.model_impl_reason
    with pytest.raises(ConfigError, match="has no native equivalent"):
        resolve_model(parse_args(["--model", str(folder), "--model-impl", "native"]))


@pytest.mark.parametrize("feature", ["rope-linear", "sliding-window"])
def test_auto_with_tp_refuses_in_one_line(bases, tmp_path, capsys, monkeypatch,
                                          feature) -> None:
    """Rank 0 of 2 (no peer is needed: the model is resolved before the process group)."""
    folder = featured(bases, tmp_path, feature)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    code = run_train(["--model", str(folder), "--tp", "2", "--dataset", "random",
                      "--seq-len", "16", "--outdir", str(tmp_path / "run")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "cannot run --tp 2" in lines[0] and FEATURES[feature][2] in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.multirank
def test_auto_fallback_trains_at_dp2_like_one_process(tmp_path: Path) -> None:
    """The combined Llama (biases, gelu, linear RoPE) and the sliding-window Qwen3."""
    for arch in ("llama_biased", "qwen3_sliding"):
        save_tiny_model(tmp_path / arch, arch, tokenizer=False)

    def run(arch: str, name: str, world: int) -> list[str]:
        return ["--model", str(tmp_path / arch), "--dataset", "random", "--seq-len", "32",
                "--fp32", "--max-steps", "3", "--seed", "5", "--lr", "3e-3",
                "--batch-size", str(4 // world), "--outdir", str(tmp_path / "runs" / name)]

    archs = ("llama_biased", "qwen3_sliding")
    env = {"LOOM_CACHE_DIR": str(tmp_path / "cache")}
    for world in (1, 2):
        runs = [run(a, f"{a}-{world}", world) for a in archs]
        job = run_ranks(world, ["tests/workers/parity_worker.py", json.dumps(runs)],
                        timeout=1200, env=env)
        assert job.ok, job.describe()
    for arch in archs:
        config = json.loads((tmp_path / "runs" / f"{arch}-2" / "config.json").read_text())
        assert config["model"]["model_impl"] == "transformers", config["model"]
        assert "has no" in config["model"]["model_impl_reason"], config["model"]
        reference = losses(tmp_path / "runs" / f"{arch}-1")
        assert len(reference) == 3
        torch.testing.assert_close(losses(tmp_path / "runs" / f"{arch}-2"), reference,
                                   rtol=LOSS_RTOL, atol=0)
