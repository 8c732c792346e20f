"""Validation, in one place: checks that need no process group (shapes, divisibility by
tp, ranges, combinations), run on the final config."""

from __future__ import annotations

import importlib.util
import math

from loom.config.compose import refuse_combinations
from loom.config.families import flag_groups
from loom.config.job import JobConfig
from loom.config.mixture import parse_mixture
from loom.config.numbers import check_number, check_numbers
from loom.config.optim import NS_COEFFICIENT, ns_coefficients
from loom.config.pipeline_layout import validate_pipeline
from loom.config.schema import EvalConfig, OutputConfig, ParallelConfig
from loom.config.valsets import DEFAULT_SET, val_sets
from loom.errors import ConfigError

HIST_KINDS = ("logits", "grads", "acts", "attn", "ffn")


def _validate_output(o: OutputConfig) -> None:
    unknown = set(o.hist.split(",")) - set(HIST_KINDS)
    if unknown:
        raise ConfigError(f"unknown histogram kind(s) {', '.join(sorted(unknown))} in --hist "
                          f"($LOOM_HIST); choose from {', '.join(HIST_KINDS)}")
    if o.hist_layers != "all" and not all(
            part.strip().isdigit() for part in o.hist_layers.split(",")):
        raise ConfigError(f"--hist-layers {o.hist_layers!r} ($LOOM_HIST_LAYERS): 'all' or "
                          "comma-separated block indices, e.g. 0,3")
    if o.pyinstrument_profiler:
        require_module("pyinstrument", "--pyinstrument-profiler", "profile")
    if o.wandb:
        require_module("wandb", "--wandb", "wandb")
    if o.tensorboard:
        require_module("tensorboard", "--tensorboard", "tensorboard")


def require_module(module: str, flag_name: str, extra: str) -> None:
    """A flag that needs an optional package fails early, in one line, when it is missing."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ValueError:  # sys.modules[module] is None: deliberately unavailable
        found = False
    if not found:
        raise ConfigError(f"{flag_name} needs the {module} package: pip install 'loom[{extra}]'")


def knob_warnings(p: ParallelConfig, budget_given: bool) -> list[str]:
    """Accepted settings that will not do what the user probably expects."""
    warnings = []
    if budget_given and not p.compile:
        warnings.append("--act-mem-budget has no effect without --compile "
                        "(it sets the compiler's partitioner budget)")
    return warnings


def check_expert_layout(ep: int, etp: int, tp: int, dp_shard_cp: int | None,
                        dp_shard_cp_name: str = "--dp-shard x --cp") -> None:
    """Expert parallel spans `ep` of the dp_shard x cp x tp ranks at --etp 1 (whole experts
    split across tp ranks too) or of the dp_shard x cp ranks at --etp tp (each expert
    tensor-parallel over tp), as torchtitan lays it out. Checked on the flags (an explicit
    --dp-shard) and again by the mesh (the resolved one)."""
    if etp not in (1, tp):
        raise ConfigError(f"--etp {etp} must be 1 or --tp {tp}")
    if ep < 1:
        raise ConfigError(f"--ep must be >= 1, got {ep}")
    if dp_shard_cp is None:
        return
    region, what = dp_shard_cp * tp, f"{dp_shard_cp_name} x --tp"
    if etp == tp > 1:
        region, what = dp_shard_cp, dp_shard_cp_name
    if region % ep:
        raise ConfigError(f"--ep {ep} must divide {what} = {region} (at --etp {etp} expert "
                          f"parallel spans the {what} ranks)")


def check_family_flags(cfg: JobConfig) -> None:
    """Each registered family's own checks of its flags (`loom.config.families`)."""
    for group in flag_groups():
        if hasattr(group, "check"):
            cfg.model.flags_of(group).check(cfg)


def _validate_strings(cfg: JobConfig) -> None:
    """Values that argparse accepts (empty strings) but no run can use (numbers:
    `loom.config.numbers`)."""
    d, c = cfg.data, cfg.checkpoint
    for name, value in (("--dataset", d.dataset), ("--tokenizer-name", d.tokenizer_name),
                        ("--outdir", cfg.output.outdir), ("--resume", c.resume)):
        if value is not None and not value.strip():
            raise ConfigError(f"{name} must not be empty")


def _validate_eval(e: EvalConfig) -> None:
    sets = val_sets(e)  # a bad name or a name given twice: one line
    if e.val_fraction and DEFAULT_SET in sets:
        raise ConfigError("an unnamed --val-dataset and --val-fraction exclude each other "
                          "(both are the default set); pick one, or name the other NAME=PATH")
    if e.eval_every and not (e.val_fraction or e.val_dataset):
        raise ConfigError("--eval-every needs validation data: --val-dataset or --val-fraction")
    if (e.eval_tasks_every or e.eval_tasks_include) and not e.eval_tasks:
        raise ConfigError("--eval-tasks-every and --eval-tasks-include need --eval-tasks")


def _validate_cp(cfg: JobConfig) -> None:
    """Settings --cp cannot run with, as one line each (combinations with other features:
    `loom.config.compose`)."""
    p, m, seq = cfg.parallel, cfg.model, cfg.data.seq_len
    if p.cp == 1:
        return
    if seq % (2 * p.cp):
        raise ConfigError(f"--seq-len {seq} is not divisible by 2 x --cp {p.cp} = {2 * p.cp} "
                          "(each cp rank holds two mirrored chunks of the sequence)")
    if (seq // p.cp) % p.tp:
        raise ConfigError(f"--seq-len {seq} / --cp {p.cp} = {seq // p.cp} tokens per cp rank "
                          f"is not divisible by --tp {p.tp} (sequence parallel splits them)")
    if m.runs_transformers:
        raise ConfigError(f"--cp {p.cp} needs loom's own model, not the Hugging Face model "
                          f"{m.model} (context parallel replaces loom's attention)")


def _validate_doc_mask(cfg: JobConfig) -> None:
    """Layouts --doc-mask cannot run with, as one line each."""
    if not cfg.data.doc_mask:
        return
    m = cfg.model
    if m.runs_transformers:
        raise ConfigError(f"--doc-mask needs loom's own model, not transformers' module for "
                          f"{m.model} (the mask is built into loom's attention; --model-impl "
                          "auto or native imports it natively where a family serves it)")


def _validate_float8(cfg: JobConfig) -> None:
    """--float8 layouts that cannot run, one line each (the device is checked when the model
    is converted, in `loom.numerics.float8`)."""
    p, m = cfg.parallel, cfg.model
    if p.float8 == "off":
        if p.float8_emulate:
            raise ConfigError("--float8-emulate needs --float8 tensorwise or rowwise")
        return
    if m.runs_transformers:
        raise ConfigError(f"--float8 needs loom's own model, not transformers' module for "
                          f"{m.model} (the converter swaps loom's linear layers; --model-impl "
                          "auto or native imports it natively where a family serves it)")
    require_module("torchao", f"--float8 {p.float8}", "float8")


def _validate_lora(cfg: JobConfig) -> None:
    """--lora-* values and layouts LoRA is not wired for, one line each (the targets are
    checked against the model in `loom.trainer.resolve`)."""
    lo, p = cfg.lora, cfg.parallel
    if not lo.lora_rank:
        if lo.lora_targets is not None or lo.lora_dropout or lo.lora_base is not None:
            raise ConfigError("--lora-targets, --lora-dropout and --lora-base need --lora-rank")
        return
    refusals = {
        "transformers' module (--model-impl native imports it where a family serves it)":
            cfg.model.runs_transformers,
        f"--float8 {p.float8} (both swap the same linears)": p.float8 != "off",
        "--data-parallel simple-fsdp (its parametrization is untested with frozen weights)":
            p.data_parallel != "fsdp2",
        f"--pp {p.pp} (untested with LoRA; use --pp 1)": p.pp > 1,
    }
    for what, refused in refusals.items():
        if refused:
            raise ConfigError(f"--lora-rank does not run with {what}")


DILOCO_FLAGS = ("sync_every", "outer_lr", "outer_momentum")
"""--ft diloco's own settings: refused with the other algorithm (they would change nothing)."""


def _validate_ft(cfg: JobConfig) -> None:
    """--ft-replica-groups: the layouts its parity test covers inside each group (every one
    but --dp-replicate, which the groups replace, and a stream, whose position the groups
    do not share), torchft installed, and the group and lighthouse `loom launch` hands
    each group; every other combination refused in one line until a test runs it."""
    p = cfg.parallel
    given = [f"--{n.replace('_', '-')}" for n in DILOCO_FLAGS if n in cfg.explicit]
    if given and p.ft != "diloco":
        raise ConfigError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} "
                          "--ft diloco")
    if p.ft_replica_groups == 1:
        if p.ft_lighthouse is not None or any(
                name in cfg.explicit for name in ("ft", "ft_group", "ft_join_timeout_s")):
            raise ConfigError("--ft, --ft-group, --ft-lighthouse and --ft-join-timeout-s "
                              "($LOOM_FT_GROUP, $LOOM_FT_LIGHTHOUSE, $LOOM_FT_JOIN_TIMEOUT_S) "
                              "need --ft-replica-groups")
        return
    refusals = {
        f"--dp-replicate {p.dp_replicate} (the groups are the replicas)": p.dp_replicate > 1,
        "--streaming (a stream's position is not shared across groups yet)":
            cfg.data.streaming,
    }
    for what, refused in refusals.items():
        if refused:
            raise ConfigError(f"--ft-replica-groups does not run with {what}")
    require_module("torchft", "--ft-replica-groups", "ft")
    if p.ft_lighthouse is None:
        raise ConfigError(f"--ft-replica-groups {p.ft_replica_groups} needs torchft's "
                          "lighthouse: start the job with loom launch --ft-replica-groups "
                          f"{p.ft_replica_groups}")
    if p.ft_group >= p.ft_replica_groups:
        raise ConfigError(f"--ft-group {p.ft_group} ($LOOM_FT_GROUP) must be below "
                          f"--ft-replica-groups {p.ft_replica_groups}")


def _validate_optim(cfg: JobConfig) -> None:
    """Muon's knobs only with Muon; its coefficients three finite numbers."""
    o = cfg.optim
    given = sorted(name for name in cfg.explicit if name.startswith("muon_"))
    if o.optimizer != "muon" and given:
        raise ConfigError(f"--{given[0].replace('_', '-')} needs --optimizer muon")
    try:
        coefficients = ns_coefficients(o.muon_ns_coefficients)
        if not all(math.isfinite(c) for c in coefficients):
            raise ValueError
    except ValueError:
        raise ConfigError(f"--muon-ns-coefficients is {o.muon_ns_coefficients!r}, not three "
                          "finite numbers a,b,c") from None
    for name, value in zip("abc", coefficients, strict=True):
        check_number(f"--muon-ns-coefficients {name}", value, NS_COEFFICIENT)


def validate(cfg: JobConfig) -> None:
    """Checks that need no process group: shapes, divisibility by tp, sequence limits."""
    check_numbers(cfg)  # every number's type and range, first: the checks below compare them
    m, p, d, t = cfg.model, cfg.parallel, cfg.data, cfg.train
    shape_unknown = m.runs_transformers or (m.from_hub_format and m.model_impl_reason is None)
    """Until `loom.trainer.resolve.resolve_model` reads the checkpoint's config, its shape is not
    known (--model-impl native too: the flags' defaults are no folder's shape); transformers'
    module has no loom shape at all."""
    _validate_strings(cfg)
    if "model_impl_reason" in cfg.explicit:  # given, it would pass for a choice already made
        raise ConfigError("--model-impl-reason is loom's record of why --model-impl resolved "
                          "as it did (config.json), not a setting: choose with --model-impl")
    if p.dp_shard == 0:
        raise ConfigError("--dp-shard must be >= 1 or -1 (auto), got 0")
    if d.seq_len > m.max_seq_len:
        raise ConfigError(f"--seq-len {d.seq_len} exceeds --max-seq-len {m.max_seq_len}")
    if cfg.checkpoint.save_hf and not cfg.checkpoint.checkpoint_interval:
        raise ConfigError("--save-hf exports the final checkpoint: give --checkpoint-interval")
    _validate_output(cfg.output)
    asked = [f for f in ("resume_new_data", "resume_change_model") if getattr(cfg.checkpoint, f)]
    if asked and cfg.checkpoint.resume is None:  # else accepted and never used
        raise ConfigError(f"--{asked[0].replace('_', '-')} needs --resume")
    _validate_eval(cfg.eval)
    if cfg.eval.eval_tasks and (p.pp > 1 or p.cp > 1):  # each rank runs the model whole
        raise ConfigError("--eval-tasks scores the tasks with the whole model on every rank: "
                          "not with --pp or --cp yet")
    if d.streaming and (t.max_steps is None or cfg.eval.val_fraction
                        or d.dataset == "random" or d.num_workers):
        raise ConfigError("--streaming needs --max-steps (a stream has no epoch length) and "
                          "text data; it excludes --val-fraction (use --val-dataset) and "
                          "--num-workers")
    mixture = parse_mixture(d.dataset)
    if mixture is None and (d.mixture_exhausted != "restart"
                            or "mixture_exhausted" in cfg.explicit):
        raise ConfigError("--mixture-exhausted needs a --dataset mixture (PATH:W,PATH:W,...)")
    if mixture is not None and (d.streaming or cfg.eval.val_fraction
                                or any(p == "random" for p, _ in mixture)):
        raise ConfigError("a --dataset mixture is of text, JSONL or shard sources, read "
                          "whole: it excludes 'random', --streaming and --val-fraction (use "
                          "--val-dataset)")
    if d.dataset == "random" and cfg.eval.val_dataset:
        raise ConfigError("--val-dataset needs a text --dataset (random data has no tokenizer; "
                          "use --val-fraction)")
    if not shape_unknown:
        check_family_flags(cfg)
    refuse_combinations(cfg)  # the composition matrix's refusals, one table
    _validate_cp(cfg)
    _validate_doc_mask(cfg)
    _validate_float8(cfg)
    _validate_lora(cfg)
    _validate_ft(cfg)
    _validate_optim(cfg)
    validate_pipeline(cfg)
    if m.runs_transformers and p.data_parallel != "fsdp2":
        raise ConfigError(f"--data-parallel {p.data_parallel} needs loom's own model, not the "
                          f"Hugging Face model {m.model} (use fsdp2)")
    if shape_unknown:
        return
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"--n-kv-heads {m.n_kv_heads} does not divide --n-heads {m.n_heads}")
    if m.n_heads % p.tp:
        raise ConfigError(f"--n-heads {m.n_heads} is not divisible by --tp {p.tp}")
    if m.n_kv_heads % p.tp:
        raise ConfigError(f"--n-kv-heads {m.n_kv_heads} is not divisible by --tp {p.tp}")
    if d.seq_len % p.tp:
        raise ConfigError(f"--seq-len {d.seq_len} is not divisible by --tp {p.tp} "
                          "(sequence parallel splits the sequence across tp ranks)")
