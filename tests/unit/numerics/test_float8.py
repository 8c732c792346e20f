"""--float8: the flag checks, the device rule, and which linears the converter swaps (on the
meta device, as the trainer runs it). Needs torchao (the float8 and test extras)."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from loom.config import ConfigError, parse_args
from loom.config.validate import validate
from loom.models.resolve import plain_model
from loom.numerics import float8

float8_linear = pytest.importorskip(
    "torchao.float8.float8_linear",
    reason="torchao is an optional dependency (pip install 'loom[float8]')")


@pytest.mark.parametrize(("flags", "says"), [
    (["--tp", "2"], "--tp 2 is not wired yet"),
    (["--data-parallel", "simple-fsdp"], "needs --data-parallel fsdp2"),
])
def test_layouts_float8_cannot_run_are_refused_in_one_line(flags, says):
    with pytest.raises(ConfigError, match=says):
        parse_args(["--model", "debug", "--float8", "tensorwise", *flags])


def test_transformers_module_and_emulate_without_float8_are_refused():
    cfg = parse_args(["--model", "debug", "--float8", "rowwise"])
    hf = replace(cfg, model=replace(cfg.model, model="org/repo", model_impl="transformers"))
    with pytest.raises(ConfigError, match="needs loom's own model"):
        validate(hf)
    with pytest.raises(ConfigError, match="--float8-emulate needs --float8"):
        parse_args(["--model", "debug", "--float8-emulate"])


def test_cpu_emulates_and_old_gpus_are_refused_unless_emulated(monkeypatch):
    cfg = parse_args(["--model", "debug", "--float8", "tensorwise"])
    monkeypatch.setattr(float8, "pick_device", lambda _: torch.device("cpu"))
    assert float8.emulate(cfg)
    monkeypatch.setattr(float8, "pick_device", lambda _: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))
    with pytest.raises(ConfigError, match="compute capability >= 8.9.*has 8.0"):
        float8.emulate(cfg)
    asked = replace(cfg, parallel=replace(cfg.parallel, float8_emulate=True))
    assert float8.emulate(asked)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    assert not float8.emulate(cfg)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_converter_swaps_block_linears_but_not_head_gates_or_odd_dims(recipe):
    cfg = parse_args(["--model", "moe-debug", "--float8", recipe, "--hidden-dim", "200",
                      "--moe-hidden-dim", "128"])
    with torch.device("meta"):
        model = plain_model(cfg)
    names = {n for n, p in model.named_parameters()}
    float8.convert_to_float8(model, cfg)
    f8 = {n for n, m in model.named_modules() if isinstance(m, float8_linear.Float8Linear)}
    plain = {n for n, m in model.named_modules() if type(m) is nn.Linear}
    assert {n for n, _ in model.named_parameters()} == names  # init and checkpoints see these
    assert f8 and all(n.startswith("layers.") for n in f8)
    assert all(n.endswith("router.gate") or ".feed_forward." in n for n in plain), plain
    assert any(n.endswith("router.gate") for n in plain)  # the router stays in high precision
    assert any(".feed_forward." in n for n in plain)  # the dense block's 200-wide SwiGLU
    assert type(model.output) is not float8_linear.Float8Linear
    config = next(m for m in model.modules() if isinstance(m, float8_linear.Float8Linear)).config
    assert config.emulate  # CPU
    assert config.enable_fsdp_float8_all_gather == (recipe == "tensorwise")
