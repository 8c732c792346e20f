"""--float8: the flag checks, the device rule, and which linears the converter swaps (on the
meta device, as the trainer runs it). Needs torchao (the float8 and test extras)."""

from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    parallelize_module,
)

from loom.config import ConfigError, parse_args
from loom.config.validate import validate
from loom.models.resolve import plain_model
from loom.numerics import float8
from loom.parallel.tp_styles import Styles
from loom.plan.trace import fake_world
from loom.protocols.extensions import StepContext

float8_linear = pytest.importorskip(
    "torchao.float8.float8_linear",
    reason="torchao is an optional dependency (pip install 'loom[float8]')")
torchao_float8 = pytest.importorskip("torchao.float8")
ftp = pytest.importorskip("torchao.float8.float8_tensor_parallel")


@pytest.mark.parametrize("flags", [
    ["--tp", "2"], ["--tp", "2", "--loss-impl", "loss-parallel"],
    ["--data-parallel", "simple-fsdp"], ["--cp", "2"],
])
def test_float8_layouts_with_a_parity_layout_validate(flags):
    """They used to be refused; tests/parity/test_layout_sweep.py trains each."""
    cfg = parse_args(["--model", "debug", "--float8", "tensorwise", *flags])
    assert cfg.parallel.float8 == "tensorwise"


def converted_block(recipe: str) -> nn.Module:
    """A feed-forward of three 64-wide linears (all eligible), and one plain 8-wide one."""
    block = nn.ModuleDict({"w1": nn.Linear(64, 64), "w2": nn.Linear(64, 64),
                           "small": nn.Linear(8, 8)})
    config = torchao_float8.Float8LinearConfig.from_recipe_name(recipe)
    torchao_float8.convert_to_float8_training(
        block, config=config, module_filter_fn=lambda m, fqn: fqn != "small")
    return block


def test_tp_styles_are_torchaos_for_tensorwise_float8_linears_only():
    """torchao's float8 styles for tensorwise Float8Linears over a float8-carrying backend;
    torch's for a plain linear (torchao's refuse one), rowwise ones and over gloo."""
    tensorwise = Styles(converted_block("tensorwise"), float8_comm=True)
    assert type(tensorwise.colwise("w1")) is ftp.Float8ColwiseParallel
    assert type(tensorwise.rowwise("w2")) is ftp.Float8RowwiseParallel
    assert type(tensorwise.colwise("small")) is ColwiseParallel
    assert type(tensorwise.prepare_input("w1")) is ftp.PrepareFloat8ModuleInput
    assert type(tensorwise.prepare_input("")) is PrepareModuleInput  # holds the plain one
    for styles in (Styles(converted_block("rowwise"), float8_comm=True),
                   Styles(converted_block("tensorwise"), float8_comm=False)):
        assert type(styles.colwise("w1")) is ColwiseParallel
        assert type(styles.prepare_input("w1")) is PrepareModuleInput


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


def test_deepseek_v3_debug_shapes_take_float8_but_its_routers_and_mtp_do_not():
    """Every latent-attention projection (the low-rank ones too: 32 and 48 wide), the dense
    SwiGLU and the shared experts are float8-sized at the debug preset; the family's router
    gates (its spec's `routers`) and the MTP module (a head part, like the output) stay in
    high precision."""
    cfg = parse_args(["--model", "deepseek-v3-mtp-debug", "--float8", "tensorwise"])
    with torch.device("meta"):
        model = plain_model(cfg)
    float8.convert_to_float8(model, cfg)
    plain = {n for n, m in model.named_modules() if type(m) is nn.Linear}
    gates = {n for n, m in model.named_modules() if n.endswith("router.gate")}
    assert len(gates) == 3 and gates <= plain, gates  # two MoE blocks and the MTP block
    assert {n for n in plain - gates if not n.startswith("mtp.")} == set(), plain
    f8 = {n for n, m in model.named_modules() if isinstance(m, float8_linear.Float8Linear)}
    for layer in range(3):
        for linear in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo"):
            assert f"layers.{layer}.attention.{linear}" in f8, (layer, linear)
    assert {"layers.0.feed_forward.w1", "layers.1.moe.shared_experts.w2"} <= f8
    assert type(model.output) is not float8_linear.Float8Linear


def test_tensorwise_scales_are_precomputed_for_weights_on_two_meshes():
    """Under dp_shard x tp a plan may leave a linear whole on the tp ranks (DeepSeek-V3's
    low-rank down-projections): its FSDP2-sharded weight lives on the dp_shard mesh, a
    head-split one's on dp_shard x tp. torchao's one stacked amax took a single mesh and
    the step hook raised after the first update; each mesh now reduces its own weights."""
    block = nn.ModuleDict({"w1": nn.Linear(64, 64), "w2": nn.Linear(64, 64)})
    config = torchao_float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    torchao_float8.convert_to_float8_training(block, config=config)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        parallelize_module(block["w1"], mesh["tp"], ColwiseParallel())
        for name in ("w1", "w2"):
            fully_shard(block[name], mesh=mesh["dp_shard"])
        meshes = {block[name].weight.device_mesh.mesh_dim_names for name in ("w1", "w2")}
        assert meshes == {("dp_shard", "tp"), ("dp_shard",)}
        float8.precompute_scales(StepContext(model=block, token_group=None, cfg=None))
    for name in ("w1", "w2"):
        scale = block[name].weight._local_tensor._precomputed_scale
        assert scale is not None and torch.isfinite(scale) and scale > 0, (name, scale)
