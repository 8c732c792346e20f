"""The deepseek-v3 family: group-limited routing against transformers', the published
shapes' parameter counts, multi-token prediction's loss and gradients, and the arguments'
ranges."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from loom.cli import config_toml
from loom.config import LossConfig, parse_args
from loom.errors import ConfigError
from loom.lora.converter import checked_targets
from loom.losses import IGNORE_INDEX, Criterion, build_criterion, depth_targets
from loom.models.context import ForwardContext
from loom.models.deepseek_v3.args import MLA_FIELDS, DeepseekV3Args
from loom.models.deepseek_v3.hf import config_fields
from loom.models.deepseek_v3.model import DeepseekV3, GroupLimitedRouter, MTPModule
from loom.models.deepseek_v3.plan import deepseek_v3_plan
from loom.models.deepseek_v3.presets import PRESETS
from loom.models.deepseek_v3.spec import mtp_depths
from loom.models.registry import for_config
from loom.models.resolve import model_args, plain_model
from loom.parallel.pipeline_stages import stage_module
from loom.plan.command import Plan, parameter_counts, report
from tests.deepseek_folders import SHAPE, save_deepseek
from tests.harness import run_process, run_ranks
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


def criterion_of(model: DeepseekV3, loss_impl: str = "eager") -> Criterion:
    return build_criterion(LossConfig(loss_impl=loss_impl, loss_chunk_size=5), model.output,
                           depths=mtp_depths(model))


def next_token_labels(tokens: torch.Tensor) -> torch.Tensor:
    """Position i's label is token i + 1; the last position has none."""
    return F.pad(tokens[:, 1:], (0, 1), value=IGNORE_INDEX)


def test_mtp_depths_train_the_shared_embedding_and_head_and_leave_eval_alone() -> None:
    model = built(TINY)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    plain = built(replace(TINY, mtp_layers=0))
    plain.load_state_dict({k: v for k, v in model.state_dict().items()
                           if not k.startswith("mtp.")})
    model.train()
    rows = model(tokens, ctx=ForwardContext(depths=True))
    assert rows.shape == (2 * (1 + TINY.mtp_layers), 16, TINY.vocab_size)
    with torch.no_grad():
        assert torch.equal(rows[:2], plain.train()(tokens))  # the main head's logits first
        assert torch.equal(model(tokens), plain(tokens)), "no depths asked: none run"
    criterion = criterion_of(model)
    targets = criterion.targets(next_token_labels(tokens), True)
    targets[:, 0] = IGNORE_INDEX  # no main label: what the objective moves is MTP's reach
    sums = criterion.sums(rows, targets)
    assert sums[1] == 0 and sums[2] > 0
    torch.testing.assert_close(sums[0], TINY.mtp_loss_weight * sums[2])
    sums[0].backward()
    for name in ("tok_embeddings.weight", "output.weight", "mtp.0.eh_proj.weight"):
        grad = model.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name
    assert model.layers["0"].attention.wkv_a.weight.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(tokens), plain.eval()(tokens))


@pytest.mark.parametrize("loss_impl", ["eager", "chunked", "chunked-backward", "fused-linear"])
def test_each_mtp_depth_reads_the_token_that_many_ahead_and_scores_the_label_past_it(
        loss_impl: str) -> None:
    """Depth d's input at i is the embedding of token i+d (zeros past the end), its
    prediction at i scored against label i+d (token i+d+1), the sum over the valid ones;
    the criterion reports the mean over depths of those sums, in every loss mode."""
    model = built(replace(TINY, mtp_layers=2)).train()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    criterion = criterion_of(model, loss_impl)
    sums = criterion.model_sums(model, tokens, criterion.targets(next_token_labels(tokens),
                                                                 True))
    with torch.no_grad():
        embedded = model.tok_embeddings(tokens)
        prev, losses = embedded, []
        for layer in model.layers.values():
            prev = layer(prev, model.rope)
        main = F.cross_entropy(model.output(model.norm(prev))[:, :15].flatten(0, 1),
                               tokens[:, 1:].flatten(), reduction="sum")
        for depth, module in enumerate(model.mtp.values(), start=1):
            shifted = torch.zeros_like(embedded)
            shifted[:, :-depth] = embedded[:, depth:]
            prev, normed = module(prev, shifted, model.rope)
            logits = model.output(normed)[:, :16 - depth - 1]
            losses.append(F.cross_entropy(logits.flatten(0, 1), tokens[:, depth + 1:].flatten(),
                                          reduction="sum"))
    depths = torch.stack(losses).mean()
    torch.testing.assert_close(sums, torch.stack([main + TINY.mtp_loss_weight * depths, main,
                                                  depths]), rtol=1e-5, atol=0)


def test_mtp_honours_the_answer_mask() -> None:
    """Chat data masks the prompt and the padding (`IGNORE_INDEX`): every depth's targets
    are the labels d ahead, so a masked label stays masked at every depth. Changing only
    tokens whose labels are all masked (the padding after the answer) leaves the MTP loss
    as it was (they were MTP targets when its targets came from the input ids); changing
    an answer label moves it."""
    model = built(replace(TINY, mtp_layers=2)).train()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    labels = next_token_labels(tokens)
    labels[:, :5] = IGNORE_INDEX  # the prompt
    labels[:, 11:] = IGNORE_INDEX  # padding: tokens 12 ... 15 are no one's target
    criterion = criterion_of(model)
    targets = criterion.targets(labels, True)
    for depth in range(3):  # depth d at i scores label i + d, masked where it is
        want = F.pad(labels[:, depth:], (0, depth), value=IGNORE_INDEX)
        assert torch.equal(targets[:, depth], want)

    def mtp_loss(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return criterion.model_sums(model, tokens, criterion.targets(labels, True))[2]

    padded = tokens.clone()
    padded[:, 12:] = (padded[:, 12:] + 1) % 64  # other padding ids
    assert torch.equal(mtp_loss(padded, labels), mtp_loss(tokens, labels))
    answer = labels.clone()
    answer[0, 8] = (answer[0, 8] + 1) % 64
    assert not torch.equal(mtp_loss(tokens, answer), mtp_loss(tokens, labels))
    unmasked = next_token_labels(tokens)  # the padding's labels counted: the loss moves
    assert not torch.equal(mtp_loss(padded, unmasked), mtp_loss(tokens, unmasked))


def test_a_document_mask_keeps_each_depth_within_its_document() -> None:
    """Under --doc-mask a depth whose input token d ahead lies in a later document has no
    target (the main loss already ignores each document's first token)."""
    labels = torch.arange(10)[None].clone()
    documents = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2, 2]])
    targets = depth_targets(labels, 2, documents)
    assert targets[0, 1].tolist() == [1, 2, 3, -100, 5, 6, -100, 8, 9, -100]
    assert targets[0, 2].tolist() == [2, 3, -100, -100, 6, -100, -100, 9, -100, -100]


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
    the last holds the MTP modules with the head and returns every depth's rows. Run by
    hand as a schedule would, two micro-batches each weighing its share of the step's
    valid tokens: every gradient, the first stage's embedding's (which MTP reaches only
    through what it was sent) included, and the depths' loss are the whole model's."""
    model = built(TINY).train()
    criterion = criterion_of(model)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3))
    labels = next_token_labels(tokens)
    count = (labels != IGNORE_INDEX).sum()
    whole = criterion.model_sums(model, tokens, criterion.targets(labels, True))
    (criterion.objective(whole) / count).backward()
    stages = [stage_module(model, range(0, 2)), stage_module(model, range(2, 5))]
    assert stages[0].mtp is None and stages[1].mtp is not None
    assert mtp_depths(stages[0]).count == mtp_depths(stages[1]).count == 1
    for stage in stages:
        stage.zero_grad()
    sums = []
    for micro, micro_labels in zip(tokens.chunk(2), labels.chunk(2), strict=True):
        ctx = ForwardContext(token_ids=micro, depths=True)
        sent = stages[0](micro, ctx=ctx)
        assert sent.shape == (2 * (1 + TINY.mtp_layers), 16, TINY.dim)
        received = sent.detach().requires_grad_()
        micro_sums = criterion.sums(stages[1](received, ctx=ctx),
                                    criterion.targets(micro_labels, True))
        (criterion.objective(micro_sums) / count).backward()
        sent.backward(received.grad)
        sums.append(micro_sums.detach())
    for stage in stages:
        for name, p in stage.named_parameters():
            ref = model.get_parameter(name).grad
            torch.testing.assert_close(p.grad, ref, rtol=1e-5, msg=name,
                                       atol=1e-6 * ref.abs().max().item())
    torch.testing.assert_close(sum(sums), whole.detach(), rtol=1e-5, atol=0)


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
def test_mtp_composes_with_every_loss_and_the_document_mask(mode: str, doc_mask: bool) -> None:
    """MTP is scored by the criterion, so every --loss-impl and --doc-mask take it, at one
    process and at --tp 2, from the preset's MTP module or --mtp-layers alike (the runs:
    tests/parity/test_deepseek_v3_mtp_losses.py)."""
    extra = ["--loss-impl", mode, *(["--doc-mask"] if doc_mask else [])]
    for argv in (["--model", "deepseek-v3-mtp-debug"],
                 ["--model", "deepseek-v3-debug", "--mtp-layers", "2"],
                 ["--model", "deepseek-v3-mtp-debug", "--tp", "2"]):
        cfg = parse_args([*argv, "--dataset", "random", *extra])
        assert model_args(cfg).mtp_layers >= 1 and cfg.data.doc_mask is doc_mask


@pytest.mark.parametrize("source", ["preset", "hub_folder"])
def test_loom_train_runs_mtp_with_the_document_mask_and_the_fused_loss(tmp_path,
                                                                       source: str) -> None:
    """The preset's MTP module with --doc-mask; a DeepseekV3ForCausalLM folder (its family
    known only once its config is read) given --mtp-layers with the fused loss: both
    train and report the depths' loss (once refused, as the loss ran inside the model)."""
    argv = ["--model", "deepseek-v3-mtp-debug", "--doc-mask"]
    if source == "hub_folder":
        argv = ["--model", str(save_deepseek(tmp_path / "ds", tokenizer=False)),
                "--mtp-layers", "1", "--loss-impl", "fused-linear"]
    proc = run_process([sys.executable, "-m", "loom", "train", *argv, "--dataset", "random",
                        "--seq-len", "32", "--max-steps", "1", "--outdir", str(tmp_path / "out")])
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics-0.jsonl").read_text()
            .splitlines()]
    assert any(row.get("mtp/loss", 0) > 0 for row in rows), rows


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


def test_compiled_mtp_at_one_process_compiles_once(tmp_path: Path) -> None:
    """--compile at one process traces model and loss as one graph. The depths' loss is
    the criterion's, with no Python state in the forward to guard on, so eight
    micro-batches a step for four steps run one compiled graph: Dynamo's
    `error_on_recompile` (tests/workers/compile_counters_worker.py) fails the run on any
    recompile, as the per-forward MTP counter once made every micro-batch do."""
    argv = ["--model", "deepseek-v3-mtp-debug", "--dataset", "random", "--vocab-size", "128",
            "--seq-len", "16", "--batch-size", "1", "--fp32", "--compile",
            "--compile-backend", "aot_eager", "--grad-accum-steps", "8", "--max-steps", "4",
            "--outdir", str(tmp_path / "run")]
    job = run_ranks(1, ["tests/workers/compile_counters_worker.py", json.dumps({"mtp": argv})],
                    timeout=900)
    assert job.ok, job.describe()
    seen = json.loads(job.ranks[0].stdout.strip().splitlines()[-1])["mtp"]
    assert seen["steps"] == 4 and not seen["graph_breaks"], seen
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics-0.jsonl").read_text()
            .splitlines()]
    assert any("mtp/loss" in row for row in rows), "the criterion reports the depths' loss"
