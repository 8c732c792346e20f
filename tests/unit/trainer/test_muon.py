"""--optimizer muon at one process: the groups (family-neutral, by name and shape), and each
step equal to torch's own optimizers: torch.optim.Muon on the same matrices (a 3-D expert
weight: each expert's matrix as its own parameter), torch.optim.AdamW on the rest."""

from __future__ import annotations

import pytest
import torch

from loom.checkpoint.schema import SchemaError, _param_group
from loom.compat import newton_schulz
from loom.config import ConfigError, OptimConfig, parse_args, validate
from loom.lora.converter import LoraSettings, apply_lora
from loom.models.llama.model import ModelArgs
from loom.models.moe.model import MoEArgs, MoETransformer
from loom.models.resolve import plain_model
from loom.plan.trace import PEAK, fake_world, trace_step
from loom.trainer.muon import newton_schulz_fp32
from loom.trainer.optim import build_lr_scheduler, build_optimizer, takes_muon
from tests.tiny import tiny_model

MUON = OptimConfig(optimizer="muon", lr=2e-2, warmup_steps=2, lr_schedule="linear")
STEPS = 5
WQ = "layers.0.attention.wq.weight"


def moe_model() -> MoETransformer:
    args = MoEArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
                   n_experts=4, moe_hidden_dim=24)
    return tiny_model(args, cls=MoETransformer)


def test_the_blocks_matrices_take_muon_and_the_rest_adamw() -> None:
    names = {n for n, p in moe_model().named_parameters() if takes_muon(n, p)}
    assert "layers.0.attention.wq.weight" in names and "layers.0.feed_forward.w2.weight" in names
    assert {"layers.1.moe.experts.w1", "layers.1.moe.shared_experts.w3.weight"} <= names
    for other in ("tok_embeddings.weight", "output.weight", "norm.weight",
                  "layers.0.attention_norm.weight", "layers.1.moe.router.gate.weight"):
        assert other not in names
    hf = torch.zeros(8, 4)
    assert takes_muon("model.layers.3.mlp.gate_proj.weight", hf)
    assert not takes_muon("model.layers.3.mlp.gate.weight", hf)  # Hugging Face's router
    assert not takes_muon("model.layers.3.self_attn.q_proj.bias", torch.zeros(8))


def test_lora_adapters_take_muon_and_nothing_else_trains() -> None:
    model = tiny_model(ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=64, multiple_of=16))
    apply_lora(model, LoraSettings(4, 8.0, ("attention.wq",), 0.0))
    opt = build_optimizer(model, MUON)
    (group,) = opt.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert group["kind"] == "muon" and opt.adamw is None
    assert sorted(names[id(p)].rsplit(".", 1)[1] for p in group["params"]) == [
        "lora_A", "lora_B"]


def torch_reference(model: torch.nn.Module, cfg: OptimConfig):
    """Copies of the model's trainable parameters under torch.optim.Muon (each expert's
    matrix its own copy) and torch.optim.AdamW, with loom's settings for both."""
    muon, adamw = {}, {}
    for name, p in model.named_parameters():
        if not takes_muon(name, p):
            adamw[name] = p.detach().clone().requires_grad_()
        elif p.ndim == 3:
            for e in range(p.shape[0]):
                muon[f"{name}/{e}"] = p[e].detach().clone().requires_grad_()
        else:
            muon[name] = p.detach().clone().requires_grad_()
    opts = [torch.optim.Muon(muon.values(), lr=cfg.lr, weight_decay=0.1, momentum=0.95,
                             nesterov=True, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(adamw.values(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                              weight_decay=0.1)]
    return {**muon, **adamw}, opts


def reference_value(params: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name in params:
        return params[name]
    return torch.stack([params[f"{name}/{e}"] for e in range(len(params))
                        if f"{name}/{e}" in params])


@pytest.mark.parametrize("nesterov", [True, False])
def test_each_step_equals_torch_muon_and_adamw(nesterov: bool) -> None:
    cfg = OptimConfig(**{**MUON.__dict__, "muon_nesterov": nesterov})
    model = moe_model()
    params, opts = torch_reference(model, cfg)
    for o in opts[:1]:
        o.param_groups[0]["nesterov"] = nesterov
    opt = build_optimizer(model, cfg)
    start = model.get_parameter(WQ).detach().clone()
    schedulers = [build_lr_scheduler(o, cfg, STEPS) for o in (opt, *opts)]
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for name, p in model.named_parameters():
            p.grad = torch.randn(p.shape, generator=generator)
            if name in params:
                params[name].grad = p.grad.clone()
            else:
                for e in range(p.shape[0]):
                    params[f"{name}/{e}"].grad = p.grad[e].clone()
        for o in (opt, *opts):
            o.step()
        for s in schedulers:
            s.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), reference_value(params, name).detach(),
                                   rtol=1e-6, atol=1e-6, msg=name)
    moved = model.get_parameter(WQ) - start
    assert moved.abs().max() > 1e-3, "the matrices should move"


@pytest.mark.parametrize(("flags", "message"), [
    (["--muon-momentum", "0.9"], "--muon-momentum needs --optimizer muon"),
    (["--optimizer", "muon", "--muon-ns-coefficients", "1,2"], "not three finite numbers"),
    (["--optimizer", "muon", "--muon-ns-coefficients", "1,2,nan"], "not three finite"),
])
def test_muon_flags_are_checked(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(parse_args(["--model", "debug", *flags]))


def test_the_fp32_iteration_is_torchs_in_float32() -> None:
    """--muon-ns-dtype fp32 agrees with torch's bfloat16 Newton-Schulz to bfloat16's
    precision, on tall and wide matrices, and keeps float32's (its own rerun is exact)."""
    gen = torch.Generator().manual_seed(5)
    for shape in ((48, 32), (32, 48)):
        grad = torch.randn(shape, generator=gen)
        ours = newton_schulz_fp32(grad, (3.4445, -4.775, 2.0315), 5, 1e-7)
        theirs = newton_schulz(grad, (3.4445, -4.775, 2.0315), 5, 1e-7)
        assert ours.dtype == torch.float32 and ours.shape == grad.shape
        torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=3e-2)
        assert (ours - theirs.float()).abs().max() > 1e-4  # not the bfloat16 result itself


def test_plan_counts_one_muon_buffer_per_matrix() -> None:
    """`loom plan` builds the run's optimizer: at dp 2, AdamW's two fp32 states of each
    rank's half of the other parameters, and one momentum buffer of the matrices' half, each
    tensor with its fp32 step count."""
    flags = ["--model", "debug", "--dim", "64", "--n-layers", "2", "--n-heads", "4",
             "--n-kv-heads", "2", "--vocab-size", "128", "--seq-len", "16", "--fp32",
             "--dp-shard", "2", "--batch-size", "1"]
    with torch.device("meta"):
        model = plain_model(parse_args(flags))
    named = list(model.named_parameters())
    matrices = [p.numel() for n, p in named if takes_muon(n, p)]
    rest = [p.numel() for n, p in named if not takes_muon(n, p)]
    with fake_world(2):
        muon = trace_step(parse_args([*flags, "--optimizer", "muon"]), 2)[PEAK]["OptState"]
        adamw = trace_step(parse_args(flags), 2)[PEAK]["OptState"]
    assert adamw == 2 * 4 * (sum(matrices) + sum(rest)) // 2 + 4 * len(named)
    assert muon == 4 * sum(matrices) // 2 + 2 * 4 * sum(rest) // 2 + 4 * len(named)


GROUP = {"params": ["layers.0.attention.wq.weight"], "kind": "muon", "lr": 1e-3,
         "initial_lr": 1e-3, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
         "ns_coefficients": [3.4445, -4.775, 2.0315], "ns_steps": 5, "eps": 1e-7,
         "adjust_lr_fn": "match_rms_adamw", "ns_dtype": "bf16"}


@pytest.mark.parametrize(("change", "message"), [
    ({}, None), ({"ns_steps": 10**9}, "ns_steps"), ({"momentum": 2.0}, "momentum"),
    ({"ns_coefficients": [1.0, 2.0]}, "ns_coefficients"), ({"nesterov": 1}, "nesterov"),
    ({"adjust_lr_fn": "__import__"}, "adjust_lr_fn"), ({"extra": 1}, "unknown key"),
])
def test_a_checkpoints_muon_group_is_checked(change: dict, message: str | None) -> None:
    """loop.json's Muon groups hold only Muon's keys, each in its flag's range (a hostile
    checkpoint cannot hand the optimizer a huge iteration count or a non-choice)."""
    group = {**GROUP, **change}
    if message is None:
        _param_group(group, "param_groups[1]")
        return
    with pytest.raises(SchemaError, match=message):
        _param_group(group, "param_groups[1]")


def stepped(found_inf: float | None, grads: dict[str, torch.Tensor]):
    """Muon + AdamW over a fresh tiny model, one step at `grads` (found_inf as the trainer
    sets it: None unmasked, 0 apply, 1 skip); its parameters and state after."""
    torch.manual_seed(0)
    model = moe_model()
    optimizer = build_optimizer(model, MUON)
    for name, p in model.named_parameters():
        p.grad = grads[name].clone()
    if found_inf is not None:
        optimizer.found_inf = torch.tensor(found_inf)
    optimizer.step()
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: {k: v.clone() for k, v in optimizer.state[p].items()}
             for n, p in model.named_parameters()})


def test_a_masked_step_skips_on_the_device_and_an_applied_one_is_the_plain_step() -> None:
    """The trainer's masked update (no host read of finiteness each step): found_inf 1 with
    NaN gradients leaves every weight as it was and creates state with no update counted;
    found_inf 0 is exactly the unmasked step."""
    torch.manual_seed(1)
    grads = {n: torch.randn_like(p) for n, p in moe_model().named_parameters()}
    assert build_optimizer(moe_model(), MUON).defaults["fused"], "the trainer masks it"
    plain_params, plain_state = stepped(None, grads)
    applied_params, applied_state = stepped(0.0, grads)
    for name in plain_params:
        assert torch.equal(applied_params[name], plain_params[name]), name
        for key, value in plain_state[name].items():
            assert torch.equal(applied_state[name][key], value), (name, key)
    nan = {n: torch.full_like(g, float("nan")) for n, g in grads.items()}
    skipped_params, skipped_state = stepped(1.0, nan)
    torch.manual_seed(0)
    before = dict(moe_model().named_parameters())
    for name, value in skipped_params.items():
        assert torch.equal(value, before[name].detach()), name
        assert float(skipped_state[name]["step"]) == 0, name
    assert torch.equal(skipped_state[WQ]["momentum_buffer"], torch.zeros_like(grads[WQ]))
