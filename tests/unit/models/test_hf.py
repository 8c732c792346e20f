"""The Hugging Face path without a process group: config resolution (tp forced to 1,
selective AC), model loading and its one-line errors, the logits adapter, the decoder block
list, the model's own activation checkpointing, losses and FLOP counting on a HF model."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from loom.config import ConfigError, LossConfig, config_from_flags, parse_args
from loom.config.resolved import Facts, settled
from loom.data.loaders import tokenizer_vocab
from loom.losses import build_loss, loss_impl_for
from loom.models.transformers.model import (
    HFCausalLM,
    hf_model_from_config,
    hf_shape,
    load_hf_config,
    load_hf_model,
)
from loom.models.transformers.plan import apply_hf_ac, decoder_blocks
from loom.observability import flops
from tests.hf_models import ARCHITECTURES, MODEL_VOCAB, SHAPE, save_tiny_model


def tiny(arch: str, seed: int = 0) -> HFCausalLM:
    config_class, extra = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**SHAPE, **extra)
    return HFCausalLM(transformers.AutoModelForCausalLM.from_config(config))


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("hf") / "llama", "llama")


def tokens(batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, MODEL_VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))


def test_hf_model_runs_at_tp_one_with_one_warning() -> None:
    cfg = config_from_flags({"model": "org/model", "model_impl": "transformers", "tp": 2},
                            environ={})
    assert cfg.parallel.tp == 1 and cfg.parallel.dp_shard == -1
    assert len([w for w in cfg.warnings if "--tp 2 ignored" in w]) == 1
    explicit = config_from_flags({"model": "org/model", "model_impl": "transformers", "tp": 2,
                                  "dp_shard": 2}, environ={})
    assert explicit.parallel.dp_shard == 4, "the tp ranks join dp_shard"
    assert config_from_flags({"model": "org/model"}, environ={}).warnings == ()


def test_selective_ac_becomes_the_models_own_block_checkpointing() -> None:
    cfg = config_from_flags({"model": "org/model", "model_impl": "transformers",
                             "activation_checkpoint": "selective"},
                            environ={})
    assert cfg.parallel.activation_checkpoint == "block" and len(cfg.warnings) == 1
    loom_cfg = config_from_flags({"model": "debug", "activation_checkpoint": "selective"},
                                 environ={})
    assert loom_cfg.parallel.activation_checkpoint == "selective"


def test_trust_remote_code_is_off_unless_asked() -> None:
    assert not parse_args(["--model", "org/model"]).model.trust_remote_code
    assert parse_args(["--model", "org/model", "--trust-remote-code"]).model.trust_remote_code


def test_model_shape_comes_from_the_hf_config(llama_folder: Path) -> None:
    cfg = parse_args(["--model", str(llama_folder), "--seq-len", "64"])
    resolved = settled(cfg, **hf_shape(cfg, load_hf_config(cfg.model)))
    m = resolved.model
    assert (m.vocab_size, m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.max_seq_len) == (
        MODEL_VOCAB, 32, 2, 4, 2, 128)
    too_long = replace(cfg, data=replace(cfg.data, seq_len=256))
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings 128"):
        hf_shape(too_long, load_hf_config(cfg.model))


def test_tokenizer_must_fit_the_models_embedding(llama_folder: Path) -> None:
    flags = parse_args(["--model", str(llama_folder), "--seq-len", "64"])
    cfg = settled(flags, **hf_shape(flags, load_hf_config(flags.model)))
    assert tokenizer_vocab(cfg, {"vocab_size": 320, "tokenizer": "t"}) == Facts()
    with pytest.raises(ConfigError, match="has 400 tokens but the model .* embeds only 328"):
        tokenizer_vocab(cfg, {"vocab_size": 400, "tokenizer": "t"})


def test_loaded_model_is_the_saved_one_in_fp32_training_mode(llama_folder: Path) -> None:
    saved = transformers.AutoModelForCausalLM.from_pretrained(llama_folder).eval()
    model = load_hf_model(parse_args(["--model", str(llama_folder)]).model)
    assert model.training and all(p.dtype == torch.float32 for p in model.parameters())
    x = tokens()
    torch.testing.assert_close(model.eval()(x), saved(input_ids=x).logits, rtol=0, atol=0)


@pytest.mark.parametrize("name, message", [
    ("{folder}/no-config", "has no config.json"),
    ("/no/such/folder", "no such folder, and not a Hugging Face repo id"),
    ("{folder}/custom", "pass --trust-remote-code"),
    ("{folder}/unknown", "cannot load it"),
])
def test_unusable_model_is_one_config_error_line(tmp_path: Path, name: str, message: str) -> None:
    (tmp_path / "no-config").mkdir()
    (tmp_path / "custom").mkdir()
    (tmp_path / "custom" / "config.json").write_text(json.dumps(
        {"model_type": "loom_custom", "auto_map": {"AutoConfig": "conf.CustomConfig"}}))
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "config.json").write_text(json.dumps({"model_type": "no-such"}))
    model = parse_args(["--model", name.format(folder=tmp_path)]).model
    with pytest.raises(ConfigError, match=message) as error:
        load_hf_config(model)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("arch, path", [("llama", "hf.model.layers"),
                                        ("gpt_neox", "hf.gpt_neox.layers")])
def test_decoder_blocks_are_the_models_layer_list(arch: str, path: str) -> None:
    model = tiny(arch)
    assert decoder_blocks(model) is model.get_submodule(path)


def test_decoder_blocks_skip_nested_and_smaller_lists() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(8))

    model = nn.Module()
    model.vision = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
    model.decoder = nn.Module()
    model.decoder.layers = nn.ModuleList(Block() for _ in range(2))
    assert decoder_blocks(model) is model.decoder.layers


def test_adapter_returns_the_models_logits_without_a_cache() -> None:
    model = tiny("qwen2").eval()
    x = tokens()
    out = model.hf(input_ids=x)
    torch.testing.assert_close(model(x), out.logits, rtol=0, atol=0)
    assert model.hf.config.use_cache is False


def count_calls(modules: list[nn.Module]) -> list[int]:
    """A one-element list that counts the forward calls of `modules` (pre-hooks: the
    recompute stops early, once it has rebuilt the last saved tensor)."""
    count = [0]

    def hook(*_: object) -> None:
        count[0] += 1

    for module in modules:
        module.register_forward_pre_hook(hook)
    return count


def test_models_own_checkpointing_recomputes_blocks_with_equal_gradients() -> None:
    """Each block's MLP runs once per forward, and once more in backward under --ac."""
    x = tokens()
    grads, calls = [], []
    for ac in (False, True):
        model = tiny("llama")
        if ac:
            apply_hf_ac(model)
        count = count_calls([block.mlp for block in decoder_blocks(model)])
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        calls.append(count[0])
    assert calls == [2, 4]
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_fused_linear_falls_back_to_compiled_on_a_hf_model(llama_folder: Path) -> None:
    cfg = parse_args(["--model", str(llama_folder), "--model-impl", "transformers",
                      "--loss-impl", "fused-linear"])
    assert loss_impl_for(cfg) == "compiled"


@pytest.mark.parametrize("mode", ["eager", "chunked", "chunked-backward"])
def test_logit_losses_run_on_a_hf_model(mode: str) -> None:
    model, x = tiny("gpt_neox"), tokens()
    labels = torch.roll(x, -1, dims=1)
    loss = build_loss(LossConfig(loss_impl=mode, loss_chunk_size=7), model)(model, x, labels)
    expected = F.cross_entropy(model(x).flatten(0, 1), labels.flatten())
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)


def test_flops_are_counted_under_fake_tensors(llama_folder: Path) -> None:
    """The FLOP count's fake-tensor model (fresh weights, no download) counts what the real
    model does."""
    model_cfg = parse_args(["--model", str(llama_folder)]).model
    count = flops.count_step_flops(lambda: hf_model_from_config(model_cfg), 2, 16)
    real = flops._train_step_flops(load_hf_model(model_cfg), torch.zeros(2, 16, dtype=torch.long))
    assert count.exact and count.flops == real > 0
