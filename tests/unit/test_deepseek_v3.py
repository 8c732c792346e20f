"""The deepseek-v3 family: group-limited routing against transformers', the published
shapes' parameter counts, multi-token prediction's loss and gradients, and the arguments'
ranges."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from loom.cli import config_toml
from loom.config import parse_args
from loom.errors import ConfigError
from loom.lora.converter import checked_targets
from loom.models.deepseek_v3.args import MLA_FIELDS, DeepseekV3Args
from loom.models.deepseek_v3.hf import config_fields
from loom.models.deepseek_v3.model import DeepseekV3, GroupLimitedRouter, MTPModule
from loom.models.deepseek_v3.plan import deepseek_v3_plan
from loom.models.deepseek_v3.presets import PRESETS
from loom.models.registry import for_config
from loom.models.resolve import model_args, plain_model
from loom.parallel.pipeline_stages import stage_module
from loom.plan.command import Plan, parameter_counts, report
from tests.deepseek_folders import SHAPE, save_deepseek
from tests.harness import run_process
from tests.routing import tie_margin

TINY = DeepseekV3Args(dim=32, n_layers=3, n_heads=4, n_kv_heads=4, vocab_size=64,
                      hidden_dim=48, n_experts=8, top_k=2, moe_hidden_dim=16,
                      max_seq_len=64, **{k: v for k, v in PRESETS["deepseek-v3-mtp-debug"].items()
                                         if k in MLA_FIELDS})


def built(args: DeepseekV3Args) -> DeepseekV3:
    torch.manual_seed(0)
    model = DeepseekV3(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" not in name else 1.0))
    model.init_buffers(torch.device("cpu"))
    return model


ROUTING_SHAPES = [  # experts, groups, groups kept, experts per token, norm, scale, tokens
    (8, 4, 2, 3, True, 2.5, (4, 16)), (16, 4, 2, 4, False, 1.0, (64,)),
    (32, 8, 3, 6, True, 16.0, (2, 3, 40)), (64, 8, 4, 8, False, 2.5, (128,)),
    (8, 1, 1, 2, True, 1.0, (3, 7))]
"""DeepSeek-V3 itself routes 256 experts in 8 groups, keeping 4, 8 per token (norm, 2.5);
V2 160 in 8, keeping 3, 6 per token; groups of 2 experts (the first row) score a group by
both its experts, so a group score taken as the best expert alone shows there too."""


@pytest.mark.parametrize(("experts", "groups", "kept", "top_k", "norm", "scale", "lead"),
                         ROUTING_SHAPES)
def test_router_matches_transformers_deepseek_v3_routing(experts: int, groups: int,
                                                         kept: int, top_k: int, norm: bool,
                                                         scale: float, lead: tuple) -> None:
    """The group-limited router against DeepSeek's published routing as transformers
    implements it (`DeepseekV3TopkRouter`: sigmoid scores, each group scored by the sum of
    its two best biased scores, top-k within the best groups, weights from the unbiased
    scores, normalised when `norm_topk_prob`, times `routed_scaling_factor`), built from the
    same config.json fields loom imports (`loom.models.deepseek_v3.hf`), with the same gate
    and correction bias. The bias is as large as a trained checkpoint's, so it moves both
    groups and experts. No choice of group or expert is within 1e-6 of a tie (checked: scores
    near 1 are rounded to ~1e-7 in fp32, so another summation order could not flip it), so
    the ids must be the same, and the weights equal to fp32 rounding."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(**{
        **SHAPE, "n_routed_experts": experts, "n_group": groups, "topk_group": kept,
        "num_experts_per_tok": top_k, "norm_topk_prob": norm, "routed_scaling_factor": scale})
    fields = config.to_dict()
    args = DeepseekV3Args(**config_fields(fields))  # the shared fields and the MLA ones
    gen = torch.Generator().manual_seed(experts * 100 + groups)
    reference = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(experts, args.dim, generator=gen) * 0.2)
        reference.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.2)
    router = GroupLimitedRouter(args)
    router.gate.weight.data.copy_(reference.weight.data)
    x = torch.randn(*lead, args.dim, generator=gen)

    with torch.no_grad():
        _, want_weights, want_idx = reference(x)
        weights, idx, scores = router(x.view(-1, args.dim), reference.e_score_correction_bias)

    biased = (scores + reference.e_score_correction_bias).view(-1, groups, experts // groups)
    by_group = biased.topk(2, dim=-1).values.sum(-1)
    if kept < groups:
        assert tie_margin(by_group, kept).min() > 1e-6, "a group choice is a near tie"
    keep = by_group >= by_group.topk(kept, dim=-1).values[:, -1:]
    candidates = biased.masked_fill(~keep[..., None], float("-inf")).flatten(1)
    assert tie_margin(candidates, top_k).min() > 1e-6, "an expert choice is a near tie"
    mine, theirs = idx.sort(dim=-1), want_idx.sort(dim=-1)
    assert torch.equal(mine.values, theirs.values)
    torch.testing.assert_close(weights.gather(1, mine.indices),
                               want_weights.gather(1, theirs.indices), rtol=1e-6, atol=0)


V2_SHAPE = dict(dim=5120, n_layers=60, vocab_size=102400, hidden_dim=12288, n_experts=160,
                top_k=6, n_shared_experts=2, moe_hidden_dim=1536, n_dense_layers=1,
                n_heads=128, n_kv_heads=128, n_group=8, topk_group=3)
V2_LITE_SHAPE = {**V2_SHAPE, "dim": 2048, "n_layers": 27, "hidden_dim": 10944, "n_experts": 64,
                 "moe_hidden_dim": 1408, "n_heads": 16, "n_kv_heads": 16, "q_lora_rank": 0,
                 "n_group": 1, "topk_group": 1}
"""DeepSeek-V2 and V2-Lite (their configs' sizes on this family's modules: the same latent
attention and expert layout), for the convention their published counts share with V3."""


@pytest.mark.parametrize(("shape", "total", "active", "tolerance"), [
    ({}, 671e9, 37e9, 0.0102), (V2_SHAPE, 236e9, 21e9, 0.01),
    (V2_LITE_SHAPE, 15.7e9, 2.4e9, 0.025)])
def test_deepseeks_published_parameter_counts(shape: dict, total: float, active: float,
                                              tolerance: float) -> None:
    """Total and activated parameters as DeepSeek published them (V3 "671B, 37B activated":
    36.63B, -1.01 %; V2 "236B, 21B": -0.7 %; V2-Lite "15.7B, 2.4B": +2.1 %). Active counts
    the input embedding as the one row a token looks up (a whole table would be 37.55B,
    21.37B, 2.66B: +1.5, +1.8, +11 %)."""
    args = replace(model_args(parse_args(["--model", "deepseek-v3"])), **shape)
    with torch.device("meta"):
        count = sum(p.numel() for p in DeepseekV3(replace(args, mtp_layers=0)).parameters())
    assert abs(count / total - 1) < 0.005, count
    multiplied = for_config(parse_args(["--model", "deepseek-v3"]).model).active_params(args)
    assert abs(multiplied / active - 1) < tolerance, multiplied


def test_moonlight_has_its_published_total_and_counts_its_lookup_as_one_row() -> None:
    """Moonlight-16B-A3B: 16B total; its "A3B" name counts the whole embedding table
    (2.91B), which FLOPs do not multiply through: 2.58B here."""
    cfg = parse_args(["--model", "moonlight-16b"])
    with torch.device("meta"):
        model = plain_model(cfg)
    assert abs(sum(p.numel() for p in model.parameters()) / 16e9 - 1) < 0.01
    active = for_config(cfg.model).active_params(model_args(cfg))
    whole_table = active + model.tok_embeddings.weight.numel() - cfg.model.dim
    assert abs(active / 2.58e9 - 1) < 0.01, active
    assert abs(whole_table / 3e9 - 1) < 0.04, whole_table


def test_mtp_loss_trains_the_shared_embedding_and_head_and_leaves_eval_alone() -> None:
    model = built(TINY)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    plain = built(replace(TINY, mtp_layers=0))
    plain.load_state_dict({k: v for k, v in model.state_dict().items()
                           if not k.startswith("mtp.")})
    model.train()
    logits = model(tokens)
    with torch.no_grad():
        assert torch.equal(logits, plain.train()(tokens))  # main head's logits only
    assert model.mtp_loss > 0
    logits.sum().mul(0).backward()  # the main loss adds nothing: what moves is MTP's
    for name in ("tok_embeddings.weight", "output.weight", "mtp.0.eh_proj.weight"):
        grad = model.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name
    assert model.layers["0"].attention.wkv_a.weight.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(tokens), plain.eval()(tokens))


def test_each_mtp_depth_reads_the_embedding_of_the_token_that_many_ahead() -> None:
    """The model shifts token ids (one embedding call, sequence-sharded under tp); the loss
    equals the definition's: depth d's input at i is the embedding of token i+d (zeros past
    the end), its logits at i scored against token i+d+1."""
    model = built(replace(TINY, mtp_layers=2)).train()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    model(tokens)
    with torch.no_grad():
        embedded = model.tok_embeddings(tokens)
        prev, losses = embedded, []
        for layer in model.layers.values():
            prev = layer(prev, model.rope)
        for depth, module in enumerate(model.mtp.values(), start=1):
            shifted = torch.zeros_like(embedded)
            shifted[:, :-depth] = embedded[:, depth:]
            prev, normed = module(prev, shifted, model.rope)
            logits = model.output(normed)[:, :16 - depth - 1]
            losses.append(F.cross_entropy(logits.flatten(0, 1), tokens[:, depth + 1:].flatten()))
    torch.testing.assert_close(model.mtp_loss, torch.stack(losses).mean(), rtol=1e-6, atol=0)


@pytest.mark.parametrize(("change", "message"), [
    (dict(kv_lora_rank=0), "kv_lora_rank"), (dict(n_group=3), "n_group"),
    (dict(qk_rope_head_dim=7), "not even"), (dict(topk_group=2, n_group=1), "topk_group"),
    (dict(yarn_factor=float("inf")), "yarn_factor")])
def test_arguments_out_of_range_are_refused(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(TINY, **change)


def test_the_plan_makes_each_mtp_module_a_unit_on_the_stage_with_the_head() -> None:
    """Each MTP module is an FSDP2 unit of its own, on the stage holding the head; a stage
    without the head holds none (pp x cp with MTP: tests/parity/
    test_deepseek_v3_mtp_pipeline.py)."""
    with torch.device("meta"):
        model = DeepseekV3(TINY)
    assert deepseek_v3_plan(model).after[0] is model.mtp["0"]
    first, last = stage_module(model, range(0, 2)), stage_module(model, range(2, 5))
    assert deepseek_v3_plan(last).after[0] is last.mtp["0"]
    assert first.mtp is None and not any(
        isinstance(unit, MTPModule) for unit in deepseek_v3_plan(first).after)


def test_two_pipeline_stages_give_mtp_the_whole_models_gradients() -> None:
    """The first stage sends each depth's embedded shifted tokens below its hidden states;
    the last holds the MTP modules with the head. Run by hand as a schedule would, two
    micro-batches each weighing half the MTP loss: every gradient, the first stage's
    embedding's (which MTP reaches only through what it was sent) included, and the MTP
    metric are the whole model's."""
    model = built(TINY).train()
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3))
    model(tokens).sum().div(tokens.numel()).backward()  # the main loss's share: small
    stages = [stage_module(model, range(0, 2)), stage_module(model, range(2, 5))]
    assert stages[0].mtp is None and stages[1].mtp is not None
    for stage in stages:
        stage.zero_grad()
        stage.microbatches = 2
    metrics = []
    for micro in tokens.chunk(2):
        sent = stages[0](micro)
        assert sent.shape == (2 * (1 + TINY.mtp_layers), 16, TINY.dim)
        received = sent.detach().requires_grad_()
        stages[1](received, token_ids=micro).sum().div(tokens.numel()).backward()
        sent.backward(received.grad)
        metrics.append(stages[1].mtp_loss.clone())
    for stage in stages:
        for name, p in stage.named_parameters():
            ref = model.get_parameter(name).grad
            torch.testing.assert_close(p.grad, ref, rtol=1e-5, msg=name,
                                       atol=1e-6 * ref.abs().max().item())
    torch.testing.assert_close(metrics[-1], model.mtp_loss, rtol=1e-6, atol=0)
    with torch.no_grad():  # evaluating, the stages keep their packing and run no MTP
        whole = model.eval()(tokens)
        torch.testing.assert_close(stages[1].eval()(stages[0].eval()(tokens)), whole,
                                   rtol=1e-5, atol=1e-6)


def test_the_family_flags_override_the_preset_and_show_in_the_config() -> None:
    """The family's own flags (issue #56's contract): unset, a width is the preset's; set,
    it wins, and `--print-config`'s [model] table carries it; out of range is refused."""
    preset = model_args(parse_args(["--model", "deepseek-v3-debug", "--dataset", "random"]))
    assert preset.kv_lora_rank == PRESETS["deepseek-v3-debug"]["kv_lora_rank"]
    cfg = parse_args(["--model", "deepseek-v3-debug", "--dataset", "random",
                      "--kv-lora-rank", "24", "--mtp-layers", "1", "--mtp-loss-weight", "0.5"])
    args = model_args(cfg)
    assert (args.kv_lora_rank, args.mtp_layers, args.mtp_loss_weight) == (24, 1, 0.5)
    assert args.q_lora_rank == preset.q_lora_rank  # unset: still the preset's
    assert "kv_lora_rank = 24" in config_toml(cfg)
    with pytest.raises(ConfigError, match="kv-lora-rank"):
        parse_args(["--model", "deepseek-v3-debug", "--dataset", "random",
                    "--kv-lora-rank", "0"])


def test_loom_plan_prints_the_published_parameter_counts() -> None:
    """`loom plan --model deepseek-v3` names 671B parameters and its per-token share:
    "parameters: 671.03B, 36.63B active per token" (DeepSeek: 671B, 37B)."""
    cfg = parse_args(["--model", "deepseek-v3", "--dataset", "random"])
    counts = parameter_counts(cfg)
    assert counts["parameters"] == pytest.approx(671e9, rel=0.001)
    assert counts["active_parameters"] == pytest.approx(37e9, rel=0.0102)
    plan = Plan(peak_gib=1.0, fits=True, breakdown={}, step_time_s=1.0, tokens_per_s=1.0,
                device_memory_gib=80.0, world_size=256, layout={}, **counts)
    line = report(plan, cfg, "H100").splitlines()[1]
    assert line == (f"parameters: {counts['parameters'] / 1e9:.2f}B, "
                    f"{counts['active_parameters'] / 1e9:.2f}B active per token")


@pytest.mark.parametrize("mode", ["eager", "chunked", "chunked-backward", "compiled",
                                  "loss-parallel", "fused-linear"])
@pytest.mark.parametrize("doc_mask", [False, True])
def test_mtp_is_refused_only_with_a_loss_it_cannot_take(mode: str, doc_mask: bool) -> None:
    """Every --loss-impl against MTP: the logits modes run it (loss-parallel at --tp 1 is
    the compiled one); fused-linear (hidden states out) and --doc-mask are refused in one
    line naming the flags, from the preset's MTP module or --mtp-layers alike."""
    extra = ["--loss-impl", mode, *(["--doc-mask"] if doc_mask else [])]
    for argv in (["--model", "deepseek-v3-mtp-debug"],
                 ["--model", "deepseek-v3-debug", "--mtp-layers", "2"]):
        argv = [*argv, "--dataset", "random", *extra]
        if mode != "fused-linear" and not doc_mask:
            assert model_args(parse_args(argv)).mtp_layers >= 1
            continue
        with pytest.raises(ConfigError, match="multi-token prediction") as refused:
            parse_args(argv)
        named = ["--loss-impl fused-linear"] * (mode == "fused-linear") + ["--doc-mask"] * doc_mask
        assert all(name in str(refused.value) for name in named), refused.value
    parse_args(["--model", "deepseek-v3-mtp-debug", "--dataset", "random", "--mtp-layers", "0",
                *extra])  # without MTP modules both are fine
    tp2 = ["--model", "deepseek-v3-mtp-debug", "--dataset", "random", "--tp", "2"]
    if mode == "loss-parallel" and not doc_mask:  # the vocabulary-sharded logits: refused
        with pytest.raises(ConfigError, match="--loss-impl loss-parallel"):
            parse_args([*tp2, *extra])
    elif mode != "fused-linear" and not doc_mask:  # tp shards the sequence: MTP runs
        assert parse_args([*tp2, *extra]).parallel.tp == 2


@pytest.mark.parametrize("source", ["preset", "hub_folder"])
def test_loom_train_refuses_mtp_with_a_loss_it_cannot_take_in_one_line(tmp_path,
                                                                        source: str) -> None:
    """The preset's MTP module with --doc-mask; a DeepseekV3ForCausalLM folder (its family
    known only once its config is read) given --mtp-layers with the fused loss."""
    argv = ["--model", "deepseek-v3-mtp-debug", "--doc-mask"]
    if source == "hub_folder":
        argv = ["--model", str(save_deepseek(tmp_path / "ds", tokenizer=False)),
                "--mtp-layers", "1", "--loss-impl", "fused-linear"]
    proc = run_process([sys.executable, "-m", "loom", "train", *argv, "--dataset", "random",
                        "--seq-len", "32", "--max-steps", "1", "--outdir", str(tmp_path / "out")])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert "multi-token prediction" in errors[0] and argv[-1] in errors[0], errors
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("q_lora_rank", "query"), [("0", "attention.wq"),
                                                    ("32", "attention.wq_b")])
def test_lora_defaults_take_the_query_projection_the_shape_has(q_lora_rank: str,
                                                              query: str) -> None:
    """The family names both query projections; a model has one (`--q-lora-rank`), and
    the default targets are those its blocks hold (a named missing one is refused)."""
    argv = ["--model", "deepseek-v3-debug", "--dataset", "random", "--lora-rank", "4",
            "--q-lora-rank", q_lora_rank]
    cfg = parse_args(argv)
    with torch.device("meta"):
        targets = checked_targets(cfg, plain_model(cfg)).split(",")
    assert targets[0] == query and {"attention.wkv_b", "attention.wo"} <= set(targets)
    assert ({"attention.wq", "attention.wq_b"} - {query}).isdisjoint(targets)
    other = "attention.wq_b" if query == "attention.wq" else "attention.wq"
    with pytest.raises(ConfigError, match="not a linear layer"):
        cfg = parse_args([*argv, "--lora-targets", other])
        with torch.device("meta"):
            checked_targets(cfg, plain_model(cfg))
