"""LoRA's config, resolution and module: the shorthand of --lora-targets, one-line refusals,
and a converted model that starts as its base and trains its adapters only."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loom.config import ConfigError, JobConfig, parse_args
from loom.config.resolved import settled
from loom.config.validate import validate
from loom.lora import converter as lora
from loom.lora.converter import LoRALinear, apply_lora, expand_targets, lora_targets_for, merged
from loom.models.llama.spec import LORA_TARGETS
from loom.models.resolve import plain_model
from loom.parallel.init import init_weights
from loom.plan.trace import PEAK, fake_world, trace_step


def lora_resolved(cfg: JobConfig) -> JobConfig:
    """`cfg` with its LoRA targets settled as the resolver settles them."""
    return settled(cfg, lora_targets=lora_targets_for(cfg))


SMALL = ["--model", "debug", "--dim", "64", "--n-layers", "2", "--n-heads", "4",
         "--n-kv-heads", "2", "--vocab-size", "128", "--seq-len", "16"]


def test_targets_shorthand_keeps_the_previous_parent():
    assert expand_targets("attention.wq,wk,wv,wo,feed_forward.w1,w2,w3") == LORA_TARGETS
    assert expand_targets("attention.wq, attention.wq") == ("attention.wq",)
    with pytest.raises(ConfigError, match="empty name"):
        expand_targets("attention.wq,,wk")


def test_family_defaults_and_given_targets_resolve_to_full_names():
    cfg = lora_resolved(parse_args([*SMALL, "--lora-rank", "4"]))
    assert cfg.lora.lora_targets == ",".join(LORA_TARGETS)
    cfg = lora_resolved(parse_args([*SMALL, "--lora-rank", "4", "--lora-targets",
                                           "attention.wq,wv"]))
    assert cfg.lora.lora_targets == "attention.wq,attention.wv"


@pytest.mark.parametrize("targets", ["attention.q_proj", "attention", "attention_norm"])
def test_a_target_that_is_not_a_block_linear_is_refused_in_one_line(targets):
    with pytest.raises(ConfigError, match=f"'{targets}' is not a linear layer"):
        lora_resolved(parse_args([*SMALL, "--lora-rank", "4", "--lora-targets",
                                         targets]))


@pytest.mark.parametrize("flags, says", [
    (["--lora-rank", "4", "--float8", "rowwise"], "--float8 rowwise"),
    (["--lora-rank", "4", "--data-parallel", "simple-fsdp"], "simple-fsdp"),
    (["--lora-rank", "4", "--pp", "2"], "--pp 2"),
    (["--lora-targets", "attention.wq"], "need --lora-rank"),
    (["--lora-rank", "-1"], "--lora-rank must be >= 0, got -1"),
    (["--lora-rank", "4", "--lora-dropout", "1.0"], "--lora-dropout must be < 1, got 1.0"),
])
def test_settings_lora_cannot_run_with_are_refused_in_one_line(flags, says):
    with pytest.raises(ConfigError, match=says.replace("-", r"\-")):
        validate(parse_args([*SMALL, *flags]))


def converted(rank: int = 4) -> tuple[nn.Module, nn.Module]:
    """(base, adapted) debug models from the same seed: the adapted one converted on meta
    and initialised as training initialises it."""
    cfg = lora_resolved(parse_args([*SMALL, "--lora-rank", str(rank)]))
    with torch.device("meta"):
        base, adapted = plain_model(cfg), plain_model(cfg)
    lora.convert(adapted, cfg)
    init_weights(base, seed=3, device=torch.device("cpu"))
    init_weights(adapted, seed=3, device=torch.device("cpu"),
                 added=lambda name: lora.adapter_std(name, cfg))
    return base, adapted


def test_converted_model_starts_as_its_base_and_trains_adapters_only():
    base, adapted = converted()
    tokens = torch.randint(128, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(base(tokens), adapted(tokens))  # B starts at zero
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(LORA_TARGETS) * 2
    assert all(n.endswith((".lora_A", ".lora_B")) for n in trainable)
    shared = dict(adapted.named_parameters())
    for name, param in base.named_parameters():  # same names, same seeded values
        assert torch.equal(shared[name], param), name


def test_an_adapted_linear_equals_its_merged_weight():
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(12, 10, bias=False), rank=3, scale=2.5, dropout=0.0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    x = torch.randn(4, 12)
    want = x @ merged(layer.weight, layer.lora_A, layer.lora_B, layer.scale).T
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_apply_lora_skips_blocks_without_the_target():
    _, adapted = converted()
    again = apply_lora(adapted, lora.LoraSettings(2, 4.0, ("feed_forward.missing",)))
    assert again == 0


def test_plan_counts_the_adapters_optimizer_state_only():
    """`loom plan`'s trace converts the model as training does: AdamW's two fp32 states of
    the adapters' dp-shard of elements (and a step count per tensor), nothing for the frozen
    base."""
    flags = [*SMALL, "--fp32", "--dp-shard", "2", "--batch-size", "1"]
    cfg = lora_resolved(parse_args([*flags, "--lora-rank", "4"]))
    with torch.device("meta"):
        model = plain_model(cfg)
    lora.convert(model, cfg)
    adapters, total = lora.trainable_count(model)
    n_adapters = sum(p.requires_grad for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    with fake_world(2):
        with_lora = trace_step(cfg, 2)[PEAK]["OptState"]
        full = trace_step(parse_args(flags), 2)[PEAK]["OptState"]
    assert with_lora == 2 * 4 * adapters // 2 + 4 * n_adapters
    assert full == 2 * 4 * (total - adapters) // 2 + 4 * (n_tensors - n_adapters)


def test_merging_the_adapters_keeps_the_logits():
    _, adapted = converted()
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if name.endswith(".lora_B"):
                param.normal_(0, 0.05)
    tokens = torch.randint(128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = adapted(tokens)
        lora.merge_adapters(adapted)
        after = adapted(tokens)
    assert all(not p.any() for n, p in adapted.named_parameters() if n.endswith(".lora_B"))
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", [
    {"lora_rank": 0, "lora_alpha": "16.0", "lora_targets": "attention.wq"},
    {"lora_rank": 8, "lora_alpha": 16.0, "lora_targets": "attention.wq"},
    {"lora_rank": 8, "lora_alpha": "nan", "lora_targets": "attention.wq"},
    {"lora_rank": 8, "lora_alpha": "1e999", "lora_targets": "attention.wq"},
    {"lora_rank": 8, "lora_alpha": "16.0", "lora_targets": "attention.__class__.x()"},
    {"lora_rank": 8, "lora_alpha": "16.0", "lora_targets": ""},
    {"lora_rank": True, "lora_alpha": "16.0", "lora_targets": "attention.wq"},
])
def test_crafted_lora_settings_in_a_checkpoint_are_refused_in_one_line(arch):
    with pytest.raises(ConfigError, match="unusable LoRA settings in the checkpoint"):
        lora.LoraSettings.recorded({"kind": "dense", **arch})


def test_recorded_settings_read_back():
    got = lora.LoraSettings.recorded({"kind": "dense", "lora_rank": 8, "lora_alpha": "16.0",
                                      "lora_targets": "attention.wq,feed_forward.w2"})
    assert got == lora.LoraSettings(8, 16.0, ("attention.wq", "feed_forward.w2"))
    assert got.scale == 2.0 and lora.LoraSettings.recorded({"kind": "dense"}) is None
