"""A transformers-built DeepseekV3ForCausalLM folder loads into loom's deepseek-v3 family
with transformers' logits and greedy text; a bad config field is refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loom.config import ConfigError, parse_args
from loom.trainer.resolve import resolve_model
from tests.deepseek_folders import bias_routing, save_deepseek
from tests.harness import REPO
from tests.hf_models import corpus_sample
from tests.native_import import assert_logits_equal_transformers, imported

transformers = pytest.importorskip("transformers")

LOGITS_RTOL = 1e-4


@pytest.mark.parametrize("variant", ["yarn_q_lora", "plain_rope_no_q_lora"])
def test_imported_logits_and_greedy_text_equal_transformers(tmp_path: Path,
                                                            variant: str) -> None:
    changes = {} if variant == "yarn_q_lora" else dict(
        q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 5e4},
        n_group=4, topk_group=2, norm_topk_prob=False)
    folder = save_deepseek(tmp_path / "ds", tokenizer=False, **changes)
    bias_routing(folder)
    cfg, model = imported(folder)
    assert model.layers["1"].moe.expert_bias.abs().sum() > 0
    assert cfg.model.family == "deepseek-v3" and cfg.model.model_impl == "native"
    hf, tokens = assert_logits_equal_transformers(model, folder, LOGITS_RTOL)
    prompt = tokens[:1, :8]
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=12, do_sample=False)
        text = prompt
        for _ in range(12):
            text = torch.cat([text, model(text)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(text, expected)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("kv_lora_rank", 0, "config.json: kv_lora_rank must be >= 1, got 0"),
    ("n_group", "2", "n_group must be an integer, got str '2'"),
    ("q_lora_rank", 2**40, "q_lora_rank must be <= 16777216, got 1099511627776"),
    ("topk_group", True, "topk_group must be an integer, got bool"),
    ("n_group", 2**17, "n_group must be <= 65536"),
    ("qk_nope_head_dim", -1, "qk_nope_head_dim must be >= 0, got -1")])
def test_hostile_config_fields_are_refused_in_one_line(tmp_path: Path, field: str, value,
                                                      message: str) -> None:
    folder = save_deepseek(tmp_path / "ds", tokenizer=False)
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        resolve_model(parse_args(["--model", str(folder), "--seq-len", "32"]))


@pytest.mark.parametrize(("setting", "reason"), [
    ("rope_interleave", "rope_interleave = False"), ("quantization_config", "quantized")])
def test_unsupported_setting_falls_back_to_transformers(tmp_path: Path, setting: str,
                                                       reason: str) -> None:
    folder = save_deepseek(tmp_path / "ds", tokenizer=False)
    config = json.loads((folder / "config.json").read_text())
    config[setting] = False if setting == "rope_interleave" else {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    cfg = resolve_model(parse_args(["--model", str(folder), "--seq-len", "32"]))
    assert cfg.model.model_impl == "transformers"
    assert reason in cfg.model.model_impl_reason


def loom(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loom", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env={"PYTHONPATH": str(REPO / "src"),
                                                      "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("source", ["hf_folder", "mtp_preset"])
def test_trained_run_exports_to_a_folder_transformers_loads(tmp_path: Path,
                                                            source: str) -> None:
    """The export checks itself (transformers' logits within 1e-4 of loom's); MTP modules
    are written as the layers after the last, under DeepSeek's names. The folder holds no
    MTP module (transformers writes none): `--mtp-layers 1` starts one fresh, said once."""
    if source == "hf_folder":
        model = str(save_deepseek(tmp_path / "ds"))
        bias_routing(tmp_path / "ds")
        (tmp_path / "text.txt").write_text(corpus_sample(20_000))
        data = ["--dataset", str(tmp_path / "text.txt"), "--mtp-layers", "1"]
    else:
        model, data = "deepseek-v3-mtp-debug", ["--dataset", "random"]
    run = loom("train", "--model", model, *data, "--seq-len", "32", "--fp32", "--max-steps",
               "2", "--checkpoint-interval", "2", "--outdir", str(tmp_path / "run"),
               cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    said = run.stdout + run.stderr  # rank 0 logs to stdout (loom.runtime.logs)
    assert said.count("initialised fresh") == (source == "hf_folder"), said
    out = tmp_path / "out"
    proc = loom("export", str(tmp_path / "run" / "checkpoints" / "step-2"), str(out),
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "DeepseekV3ForCausalLM" in proc.stdout and "checked" in proc.stdout, proc.stdout
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    mtp = {n for n in names if n.startswith("model.layers.3.")}
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.shared_head.head.weight",
            "model.layers.3.embed_tokens.weight", "model.layers.3.enorm.weight",
            "model.layers.3.mlp.experts.7.up_proj.weight"} <= mtp
    assert '"mtp/loss"' in (tmp_path / "run" / "metrics-0.jsonl").read_text()


def mtp_folder(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A transformers-built folder plus an MTP module's tensors under DeepSeek's names
    (`model.layers.3.*`, as its checkpoints and loom's export hold them), drawn away from
    the init; -> (folder, loom's MTP tensors written)."""
    from safetensors.torch import load_file, save_file

    from loom.models.deepseek_v3.hf import DeepseekV3Adapter

    folder = save_deepseek(tmp_path / "ds", tokenizer=False)
    _, model = imported(folder, "--mtp-layers", "1")
    gen = torch.Generator().manual_seed(3)
    state = {name: torch.randn(t.shape, generator=gen) if name.startswith("mtp.") else t
             for name, t in model.state_dict().items()}
    tensors = load_file(folder / "model.safetensors")
    tensors.update({name: t.contiguous() for name, t in DeepseekV3Adapter().hf_tensors(
        model.args, state.__getitem__) if name.startswith("model.layers.3.")})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder, {name: t for name, t in state.items() if name.startswith("mtp.")}


def test_mtp_weights_of_a_folder_load_and_a_missing_module_starts_fresh(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`--mtp-layers 1` reads the folder's MTP module; a folder with none (transformers
    writes none) gets the module a fresh run draws, said in one line; without the flag a
    held module is left out, said too."""
    from loom.parallel.init import seeded_value

    bare = save_deepseek(tmp_path / "bare", tokenizer=False)
    with caplog.at_level("WARNING", logger="loom"):
        _, fresh = imported(bare, "--mtp-layers", "1")
    assert "no weights for MTP module 0 (model.layers.3.*): initialised fresh" in caplog.text
    for name, param in fresh.mtp.named_parameters():
        name = f"mtp.{name}"
        assert torch.equal(param, seeded_value(param.shape, fresh.init_std(name), 0, name))
    folder, written = mtp_folder(tmp_path)
    _, model = imported(folder, "--mtp-layers", "1")
    state = model.state_dict()
    assert written.keys() == {n for n in state if n.startswith("mtp.")}
    for name, tensor in written.items():
        assert torch.equal(state[name], tensor), name
    caplog.clear()
    with caplog.at_level("WARNING", logger="loom"):
        _, plain = imported(folder)
    assert plain.mtp is None and "holds 1 MTP module(s); this run trains 0" in caplog.text


@pytest.mark.parametrize(("change", "message"), [
    ("drop", "tensor model.layers.3.enorm.weight is missing"),
    ("reshape", "tensor model.layers.3.eh_proj.weight has shape [32, 10]")])
def test_a_partial_or_misshapen_mtp_module_is_refused_in_one_line(
        tmp_path: Path, change: str, message: str) -> None:
    """Never half loaded: one tensor of the module absent, or of the wrong shape."""
    from safetensors.torch import load_file, save_file

    folder, _ = mtp_folder(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    if change == "drop":
        del tensors["model.layers.3.enorm.weight"]
    else:
        tensors["model.layers.3.eh_proj.weight"] = torch.zeros(32, 10)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        imported(folder, "--mtp-layers", "1")


def test_a_lora_runs_base_draws_the_mtp_module_its_folder_lacked(tmp_path: Path) -> None:
    """Exporting or merging a LoRA run reads its frozen base again: from the folder, and
    the fresh MTP module from the seed, as the run drew it (not a KeyError)."""
    from loom.hf.peft import base_reader
    from loom.models.registry import for_config
    from loom.parallel.init import seeded_value

    folder = save_deepseek(tmp_path / "bare", tokenizer=False)
    cfg = resolve_model(parse_args(["--model", str(folder), "--seq-len", "32", "--fp32",
                                    "--mtp-layers", "1"]))
    spec = for_config(cfg.model)
    read = base_reader(spec, spec.args_from_config(cfg.model), str(folder), seed=5)
    _, model = imported(folder, "--mtp-layers", "1")
    assert torch.equal(read("layers.1.attention.wkv_b.weight"),
                       model.layers["1"].attention.wkv_b.weight)
    name = "mtp.0.eh_proj.weight"
    drawn = seeded_value(model.mtp["0"].eh_proj.weight.shape, model.init_std(name), 5, name)
    assert torch.equal(read(name), drawn)
