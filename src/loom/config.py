"""The job configuration: declared once as dataclasses, parsed once, validated once.

Every training flag is a dataclass field whose metadata holds its help text and aliases;
the argparse parser is generated from these declarations, so a flag cannot exist in the
parser without a documented field behind it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from loom.presets import PRESETS, is_hf_model, resolve_preset


class ConfigError(ValueError):
    """A setting the user can change is invalid; reported as one line on every rank."""


def flag(default: Any, help: str, *, aliases: Sequence[str] = (), type: Callable | None = None,
         choices: Sequence[str] | None = None, hidden: bool = False,
         const: Any = None) -> Any:
    """Declare a dataclass field that is also a command-line flag."""
    meta = dict(help=help, aliases=tuple(aliases), type=type, choices=choices,
                hidden=hidden, const=const)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = flag(None, "preset, alias, Hugging Face repo id or local HF folder",
                             type=str)
    dim: int = flag(256, "model width")
    n_layers: int = flag(32, "number of transformer blocks")
    n_heads: int = flag(32, "attention heads")
    n_kv_heads: int = flag(4, "key/value heads (grouped-query attention); divides n-heads")
    multiple_of: int = flag(360, "round the SwiGLU hidden dim up to a multiple of this")
    ffn_dim_multiplier: float | None = flag(None, "scale the SwiGLU hidden dim", type=float)
    hidden_dim: int | None = flag(None, "SwiGLU hidden dim; bypasses the derivation", type=int)
    rope_theta: float = flag(10000.0, "RoPE base frequency")
    norm_eps: float = flag(1e-5, "RMSNorm epsilon")
    vocab_size: int = flag(32000, "vocabulary size (replaced by the tokenizer's size)")
    max_seq_len: int = flag(32768, "RoPE table size; seq-len must not exceed it")
    n_experts: int = flag(0, "routed experts per MoE layer (0 = dense model)")
    top_k: int = flag(2, "MoE: experts each token is routed to")
    n_shared_experts: int = flag(1, "MoE: always-on shared experts per layer")
    moe_hidden_dim: int | None = flag(None, "MoE: hidden dim of each expert "
                                      "(default: the SwiGLU hidden dim)", type=int)
    n_dense_layers: int = flag(1, "MoE: leading blocks that keep a dense feed-forward")
    score_func: str = flag("sigmoid", "MoE: router score function (computed in fp32)",
                           choices=("sigmoid", "softmax"))
    route_norm: bool = flag(True, "MoE: normalise the chosen experts' scores to sum to 1")
    route_scale: float = flag(1.0, "MoE: multiply the routed experts' weights by this")
    load_balance_coeff: float = flag(1e-3, "MoE: expert-bias step per optimizer step "
                                     "(aux-loss-free balancing; 0 disables)")
    aux_loss_coeff: float = flag(0.0, "MoE: weight of the sequence-wise balance loss (0 = off)")
    trust_remote_code: bool = flag(False, "Hugging Face --model: run the modelling code the "
                                   "repo ships (only for repos you trust)")


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = flag(1, "tensor (+ sequence) parallel degree")
    dp_replicate: int = flag(1, "replicated data-parallel degree (HSDP's outer dim)")
    dp_shard: int = flag(-1, "sharded data-parallel degree; -1 = all remaining ranks")
    reshard_after_forward: str = flag(
        "always", "free gathered parameters after forward (always = ZeRO-3, never = ZeRO-2)",
        choices=("always", "never"), const="always")
    sharding_strategy: str | None = flag(None, "deprecated; use --reshard-after-forward",
                                         type=str, hidden=True)
    activation_checkpoint: str = flag(
        "none", "recompute activations in backward", aliases=("--ac",),
        choices=("none", "block", "full", "selective"))
    compile: bool = flag(False, "torch.compile each transformer block")
    compile_mode: str = flag("default", "torch.compile mode",
                             choices=("default", "reduce-overhead", "max-autotune"))
    act_mem_budget: float = flag(1.0, "activation memory budget of the partitioner (--compile)")
    compile_backend: str = flag(
        "inductor", "torch.compile backend; aot_eager skips code generation (cheap, for tests) "
        "($LOOM_COMPILE_BACKEND)", choices=("inductor", "aot_eager"))
    dtype: str = flag("auto", "compute dtype: bf16 mixed precision (fp32 master weights), fp32, "
                      "or auto (bf16 on GPUs and native-bf16 CPUs, else fp32)",
                      choices=("auto", "bf16", "fp32"))
    reduce_dtype: str = flag("fp32", "gradient reduction dtype under mixed precision "
                             "($LOOM_REDUCE_DTYPE)", choices=("fp32", "bf16"))
    grad_divide_factor: bool = flag(
        True, "sum gradients in the collective and divide once by the dp size "
        "($LOOM_FSDP_DIVIDE_FACTOR=0 turns it off)", hidden=True)
    data_parallel: str = flag(
        "fsdp2", "data-parallel wrapper: FSDP2 units, or SimpleFSDP (parameters gathered by "
        "DTensor redistribution on access; with --compile the whole model is one graph)",
        choices=("fsdp2", "simple-fsdp"))
    ep: int = flag(1, "expert-parallel degree, borrowed from dp_shard (must divide it)")
    etp: int = flag(1, "expert tensor parallel: 1 (tp ranks split the tokens) or tp "
                    "(experts split across tp too)")
    pp: int = flag(1, "pipeline-parallel degree (the outermost mesh dim: ranks hold "
                   "consecutive layers)")
    pp_schedule: str = flag("1f1b", "pipeline schedule (interleaved-1f1b: looped stages; "
                            "zero-bubble, dualpipev: refused on torch 2.13, see README)",
                            choices=("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble",
                                     "dualpipev"))
    pp_microbatches: int = flag(0, "pipeline micro-batches per --batch-size batch (must "
                                "divide it); 0 = the fewest keeping the bubble under a quarter")
    pp_stages_per_rank: int = flag(0, "pipeline stages each rank holds; 0 = the schedule's "
                                   "(1, or 2 for interleaved-1f1b)")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = flag(3e-3, "AdamW learning rate")
    max_grad_norm: float = flag(1.0, "clip the global gradient norm; <= 0 disables")
    lr_schedule: str = flag("constant", "learning-rate schedule after warmup",
                            choices=("constant", "cosine", "linear", "wsd"))
    warmup_steps: int = flag(0, "linear warmup from 0 to --lr over this many steps")
    min_lr_ratio: float = flag(0.0, "floor of the decaying schedules, as a fraction of --lr")
    decay_fraction: float = flag(0.2, "wsd: fraction of the steps spent decaying at the end")


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = flag(5, "passes over the dataset")
    batch_size: int = flag(1, "samples per data-parallel rank per step")
    seed: int = flag(0, "seed for weights and data order (identical commands reproduce)")
    max_steps: int | None = flag(None, "stop after this many optimizer steps", type=int)
    grad_accum_steps: int = flag(1, "micro-batches accumulated per optimizer step")
    skip_nonfinite: bool = flag(False, "skip a step whose loss or gradient is not finite "
                                "(default: stop the run)")
    max_skipped_steps: int = flag(10, "--skip-nonfinite: stop after this many consecutive "
                                  "skipped steps")
    comm_timeout_s: float = flag(600.0, "end the job when a collective or a whole step "
                                 "makes no progress for this long (a stalled or dead rank)")


@dataclass(frozen=True)
class LossConfig:
    loss_impl: str = flag("eager", "cross-entropy implementation", choices=(
        "eager", "chunked", "chunked-backward", "compiled", "fused-linear", "loss-parallel"))
    loss_chunk_size: int = flag(1024, "row chunk of the chunked and fused-linear losses")
    debug_logits: bool = flag(False, "log the first step's finite-logit count and max |logit| "
                              "(materialises the full logits; $LOOM_DEBUG_LOGITS=1)", hidden=True)


@dataclass(frozen=True)
class DataConfig:
    dataset: str | None = flag(None, "hub id, local file/folder, or 'random' "
                               "(default: the embedded corpus)", type=str)
    tokenizer_name: str | None = flag(None, "hub id or local folder of a tokenizer", type=str)
    hf_split: str = flag("train", "dataset split")
    hf_text_column: str = flag("text", "column holding the text")
    hf_limit: int = flag(0, "keep this many rows, chosen deterministically (0 = all)")
    seq_len: int = flag(1024, "tokens per sample ($SEQ_LEN)")
    num_workers: int = flag(0, "data loader worker processes")
    hf_limit_seed: int = flag(0, "seed of the --hf-limit subsample ($LOOM_HF_LIMIT_SEED)",
                              hidden=True)
    streaming: bool = flag(False, "read, tokenize and pack documents on the fly, dealt to dp "
                           "ranks (needs --max-steps; resumes at the exact token)")
    cache_dir: str | None = flag(None, "tokenization cache folder ($LOOM_CACHE_DIR; "
                                 "default ~/.cache/loom)", type=str, hidden=True)


@dataclass(frozen=True)
class EvalConfig:
    val_dataset: str | None = flag(None, "validation data: hub id, local file/folder or shard "
                                   "folder (same tokenizer as --dataset)", type=str)
    val_fraction: float = flag(0.0, "hold out this fraction of --dataset's tokens for "
                               "validation, cut between documents")
    eval_every: int = flag(0, "validation loss every N steps (0 = only after the last step)")
    eval_steps: int = flag(8, "global batches per validation (at most the whole set)")


@dataclass(frozen=True)
class CheckpointConfig:
    checkpoint_interval: int = flag(0, "save a checkpoint every N steps and at the end "
                                    "(0 = no checkpoints)")
    keep_checkpoints: int = flag(2, "keep the newest K complete checkpoints")
    async_checkpoint: bool = flag(False, "write checkpoints in a background thread")
    resume: str | None = flag(None, "continue from the latest checkpoint in --outdir (bare "
                              "flag: there must be one; 'auto': if there is one) or from a "
                              "checkpoint folder", type=str, const="latest")
    sigterm_grace_s: float = flag(25.0, "on SIGTERM, save a final checkpoint only if the last "
                                  "save took at most this long (schedulers kill ~30 s later)")


@dataclass(frozen=True)
class OutputConfig:
    outdir: str | None = flag(None, "run folder (default: outputs/<timestamp>)", type=str)
    overwrite: bool = flag(False, "move a previous run in --outdir aside and start anew")
    profile: bool = flag(False, "torch profiler trace in the run folder")
    pyinstrument_profiler: bool = flag(False, "pyinstrument profile of the run "
                                       "(pip install 'loom[profile]')")
    wandb: bool = flag(False, "log to Weights & Biases (pip install 'loom[wandb]'; "
                       "WANDB_MODE=offline works without an account)")
    log_every: int = flag(0, "progress line every N steps (0 = auto, ~20 lines) ($LOOM_LOG_EVERY)")
    verbose: bool = flag(False, "show the upstream notices loom hides (README: Quiet output)")
    metrics: bool = flag(True, "per-step metrics ($LOOM_METRICS=0 turns them off: the "
                         "overhead baseline)", hidden=True)
    health_every: int = flag(1, "gradient/parameter health statistics every K steps, 0 = off "
                             "($LOOM_HEALTH_EVERY)", hidden=True)
    hist_every: int = flag(0, "histograms every N steps, 0 = off ($LOOM_HIST_EVERY)",
                           hidden=True)
    hist: str = flag("logits,grads,acts", "which histograms, comma-separated ($LOOM_HIST)",
                     hidden=True)


@dataclass(frozen=True)
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    warnings: tuple[str, ...] = ()
    """Messages produced while resolving the config, logged once by rank 0."""
    explicit: tuple[str, ...] = ()
    """Fields set by a flag or an environment knob, not by a preset or a --config file (a
    resumed run keeps the others from its checkpoint)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.default_factory for f in fields(JobConfig)
            if f.name not in ("warnings", "explicit")}


def _flag_names(name: str, aliases: Sequence[str]) -> list[str]:
    names = [f"--{name.replace('_', '-')}"]
    if "_" in name:
        names.append(f"--{name}")
    return names + list(aliases)


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage, so every rank fails with one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


HELP_GROUPS = {"model": "model (and MoE)", "parallel": "parallel", "optim": "optimisation",
               "train": "training", "checkpoint": "checkpoint", "loss": "loss", "data": "data",
               "eval": "validation", "output": "output"}
"""`loom train --help` groups, in the order of the README's flag table; every section of
`JobConfig` must be listed (a test checks it), or its flags would not exist."""


def _help(text: str, default: Any) -> str:
    """The flag's help with its default (argparse cannot show it: defaults are suppressed)."""
    if default is None or default is False:
        return text
    return f"{text} [default: {'on' if default is True else default}]"


def _presets_epilog() -> str:
    shapes = [f"{name} ({p['dim']}x{p['n_layers']}{', MoE' if p.get('n_experts') else ''})"
              for name, p in PRESETS.items()]
    return ("model presets (--model NAME; dim x layers): " + ", ".join(shapes)
            + "; a Hugging Face repo id or local folder also works")


def build_parser(prog: str = "loom train") -> argparse.ArgumentParser:
    """One argparse parser generated from the dataclass declarations (defaults suppressed,
    so the parsed namespace holds exactly the flags the user gave)."""
    parser = _Parser(prog=prog, usage="%(prog)s [FLAGS]", argument_default=argparse.SUPPRESS,
                     epilog=_presets_epilog())
    for section, title in HELP_GROUPS.items():
        group = parser.add_argument_group(title)
        for f in fields(SECTIONS[section]):
            meta = f.metadata
            kwargs: dict[str, Any] = dict(dest=f.name, help=_help(meta["help"], f.default))
            if meta["hidden"]:
                kwargs["help"] = argparse.SUPPRESS
            if isinstance(f.default, bool):
                kwargs["action"] = (argparse.BooleanOptionalAction if f.default
                                    else "store_true")
            else:
                kwargs["type"] = meta["type"] or type(f.default)
                if meta["choices"]:
                    kwargs["choices"] = meta["choices"]
                if meta["const"] is not None:
                    kwargs.update(nargs="?", const=meta["const"])
            group.add_argument(*_flag_names(f.name, meta["aliases"]), **kwargs)
    parser.add_argument("--no-reshard-after-forward", dest="reshard_after_forward",
                        action="store_const", const="never",
                        help="same as --reshard-after-forward never")
    parser.add_argument("--fp32", dest="dtype", action="store_const", const="fp32",
                        help="same as --dtype fp32")
    parser.add_argument("--config", dest="config_file", type=str,
                        help="TOML file of settings, one [section] per group; flags override it")
    parser.add_argument("--print-config", action="store_true",
                        help="print the effective config as TOML and exit")
    return parser


def _section_of(name: str) -> str:
    for section, factory in SECTIONS.items():
        if any(f.name == name for f in fields(factory)):
            return section
    raise KeyError(name)


def _resolve_sharding_strategy(explicit: dict[str, Any], warnings: list[str]) -> None:
    """Map the deprecated --sharding-strategy onto --reshard-after-forward."""
    strategy = explicit.pop("sharding_strategy", None)
    if strategy is None:
        return
    key = strategy.lower()
    if key == "full_shard":
        explicit.setdefault("reshard_after_forward", "always")
    elif key in ("shard_grad_op", "no_shard"):
        explicit.setdefault("reshard_after_forward", "never")
        warnings.append(f"--sharding-strategy {strategy} is deprecated; "
                        "use --reshard-after-forward never")
        if key == "no_shard":
            warnings.append("--sharding-strategy no_shard: parameters stay sharded "
                            "(FSDP2 has no unsharded mode); only resharding is turned off")
    elif key in ("hybrid_shard", "hybrid_shard_zero2"):
        raise ConfigError(f"--sharding-strategy {strategy} is not supported; "
                          "use --dp-replicate R --dp-shard S for HSDP")
    else:
        raise ConfigError(f"unknown --sharding-strategy {strategy!r}; "
                          "use --reshard-after-forward {always,never}")


def _environment_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Documented environment knobs, validated like flags (a bad value is an error)."""
    out: dict[str, Any] = {}
    if "LOOM_REDUCE_DTYPE" in environ:
        value = environ["LOOM_REDUCE_DTYPE"].strip().lower()
        dtypes = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}
        if value not in dtypes:
            raise ConfigError(f"LOOM_REDUCE_DTYPE must be fp32, bf16 or bfloat16, "
                              f"got {environ['LOOM_REDUCE_DTYPE']!r}")
        out["reduce_dtype"] = dtypes[value]
    if "LOOM_FSDP_DIVIDE_FACTOR" in environ:
        value = environ["LOOM_FSDP_DIVIDE_FACTOR"].strip().lower()
        if value not in ("0", "1", "true", "false"):
            raise ConfigError(f"LOOM_FSDP_DIVIDE_FACTOR must be 0 or 1, got {value!r}")
        out["grad_divide_factor"] = value in ("1", "true")
    if "LOOM_COMPILE_BACKEND" in environ:
        value = environ["LOOM_COMPILE_BACKEND"].strip().lower()
        if value not in ("inductor", "aot_eager"):
            raise ConfigError(f"LOOM_COMPILE_BACKEND must be inductor or aot_eager, got {value!r}")
        out["compile_backend"] = value
    if "LOOM_DEBUG_LOGITS" in environ:
        value = environ["LOOM_DEBUG_LOGITS"].strip().lower()
        if value not in ("0", "1", "true", "false"):
            raise ConfigError(f"LOOM_DEBUG_LOGITS must be 0 or 1, got {value!r}")
        out["debug_logits"] = value in ("1", "true")
    out.update(_data_environment(environ))
    out.update(_metrics_environment(environ))
    return out


_COUNT_KNOBS = {"LOOM_LOG_EVERY": "log_every", "LOOM_HEALTH_EVERY": "health_every",
                "LOOM_HIST_EVERY": "hist_every"}


def _metrics_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """$LOOM_LOG_EVERY, $LOOM_HEALTH_EVERY, $LOOM_HIST_EVERY (integers >= 0), $LOOM_HIST
    and $LOOM_METRICS (0 or 1); checked with the flags in `_validate_output`."""
    out: dict[str, Any] = {}
    for name, key in _COUNT_KNOBS.items():
        if name in environ:
            try:
                out[key] = int(environ[name])
            except ValueError:
                raise ConfigError(f"{name} must be an integer >= 0, "
                                  f"got {environ[name]!r}") from None
    if "LOOM_HIST" in environ:
        out["hist"] = environ["LOOM_HIST"].replace(" ", "")
    if "LOOM_METRICS" in environ:
        value = environ["LOOM_METRICS"].strip().lower()
        if value not in ("0", "1", "true", "false"):
            raise ConfigError(f"LOOM_METRICS must be 0 or 1, got {value!r}")
        out["metrics"] = value in ("1", "true")
    return out


def _validate_output(o: OutputConfig) -> None:
    for name in ("log_every", "health_every", "hist_every"):
        if getattr(o, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(o, name)}")
    unknown = set(o.hist.split(",")) - {"logits", "grads", "acts"}
    if unknown:
        raise ConfigError(f"unknown histogram kind(s) {', '.join(sorted(unknown))} in --hist "
                          "($LOOM_HIST); choose from logits, grads, acts")
    if o.pyinstrument_profiler:
        require_module("pyinstrument", "--pyinstrument-profiler", "profile")
    if o.wandb:
        require_module("wandb", "--wandb", "wandb")


def require_module(module: str, flag_name: str, extra: str) -> None:
    """A flag that needs an optional package fails early, in one line, when it is missing."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ValueError:  # sys.modules[module] is None: deliberately unavailable
        found = False
    if not found:
        raise ConfigError(f"{flag_name} needs the {module} package: pip install 'loom[{extra}]'")


def _data_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """$LOOM_HF_LIMIT_SEED (which rows --hf-limit keeps) and $LOOM_CACHE_DIR."""
    out: dict[str, Any] = {}
    if "LOOM_HF_LIMIT_SEED" in environ:
        try:
            out["hf_limit_seed"] = int(environ["LOOM_HF_LIMIT_SEED"])
        except ValueError:
            raise ConfigError("LOOM_HF_LIMIT_SEED must be an integer, "
                              f"got {environ['LOOM_HF_LIMIT_SEED']!r}") from None
    if environ.get("LOOM_CACHE_DIR"):
        out["cache_dir"] = environ["LOOM_CACHE_DIR"]
    return out


def _knob_warnings(p: ParallelConfig, budget_given: bool) -> list[str]:
    """Accepted settings that will not do what the user probably expects."""
    warnings = []
    if budget_given and not p.compile:
        warnings.append("--act-mem-budget has no effect without --compile "
                        "(it sets the compiler's partitioner budget)")
    if p.compile and p.activation_checkpoint != "none" and (
            p.tp > 1 or p.data_parallel == "simple-fsdp"):
        warnings.append(
            f"--compile with --ac {p.activation_checkpoint} at --tp {p.tp} (--data-parallel "
            f"{p.data_parallel}) is known to fail "
            "upstream in AOTAutograd ('expected all tensors_saved_with_vc_check to be "
            "Tensors'); drop --ac (use --act-mem-budget) or --compile")
    return warnings


def _fit_hf_model(values: dict[str, Any], warnings: list[str]) -> None:
    """loom's TP plan and selective AC name loom's own modules: a Hugging Face model runs at
    tp 1 (an explicit --dp-shard takes the tp ranks) and recomputes whole blocks."""
    tp = values.get("tp", 1)
    if tp != 1:
        values["tp"] = 1
        if values.get("dp_shard", -1) > 0:
            values["dp_shard"] *= tp
        warnings.append(f"--tp {tp} ignored for the Hugging Face model {values['model']} "
                        "(loom's tensor-parallel plan names its own modules); its ranks shard "
                        "data instead")
    if values.get("activation_checkpoint") == "selective":
        values["activation_checkpoint"] = "block"
        warnings.append("--ac selective on a Hugging Face model: its own gradient "
                        "checkpointing recomputes whole blocks (--ac block)")


def config_from_flags(explicit: Mapping[str, Any], environ: Mapping[str, str] | None = None,
                      from_file: Mapping[str, Any] | None = None) -> JobConfig:
    """Build the job config: defaults < preset < $SEQ_LEN < --config file < explicit flags;
    then validate."""
    environ = os.environ if environ is None else environ
    budget_given = "act_mem_budget" in explicit
    flagged = set(explicit)  # a file's values are settings, not flags given again on resume
    explicit = {**(from_file or {}), **explicit}
    warnings: list[str] = []
    _resolve_sharding_strategy(explicit, warnings)
    values: dict[str, Any] = {}
    model_name = explicit.get("model")
    if model_name is not None and not is_hf_model(model_name):
        try:
            canonical, preset = resolve_preset(model_name)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        values.update(preset)
        explicit["model"] = canonical
    environment = _environment_overrides(environ)
    values.update(environment)
    given = {*environment, *flagged, *(["seq_len"] if "SEQ_LEN" in environ else [])}
    if "SEQ_LEN" in environ:
        try:
            values["seq_len"] = int(environ["SEQ_LEN"])
        except ValueError:
            raise ConfigError(f"SEQ_LEN must be an integer, got {environ['SEQ_LEN']!r}") from None
    values.update(explicit)
    if values.get("activation_checkpoint") == "full":
        values["activation_checkpoint"] = "block"
    if model_name is not None and is_hf_model(model_name):
        _fit_hf_model(values, warnings)
    by_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for name, value in values.items():
        by_section[_section_of(name)][name] = value
    cfg = JobConfig(**{s: SECTIONS[s]()  # type: ignore[misc]
                       for s in SECTIONS}, warnings=tuple(warnings))
    cfg = replace(cfg, **{s: replace(getattr(cfg, s), **kw) for s, kw in by_section.items()})
    warnings += _knob_warnings(cfg.parallel, budget_given=budget_given)
    cfg = replace(cfg, warnings=tuple(warnings), explicit=tuple(sorted(given)))
    validate(cfg)
    return cfg


def parse_args(argv: Sequence[str]) -> JobConfig:
    """Parse `loom train` flags (and a --config file); errors become ConfigError (one line,
    exit 2). --print-config is acted on by the caller."""
    from loom.config_file import read_config_file

    explicit = vars(build_parser().parse_args(list(argv)))
    explicit.pop("print_config", None)
    path = explicit.pop("config_file", None)
    return config_from_flags(explicit, from_file=read_config_file(path, SECTIONS) if path else None)


def _validate_moe(m: ModelConfig, p: ParallelConfig) -> None:
    """Mixture-of-experts shapes and the expert-parallel degrees they allow."""
    if m.n_experts == 0:
        if p.ep != 1 or p.etp != 1:
            raise ConfigError(f"--ep {p.ep} / --etp {p.etp} need a mixture-of-experts model "
                              "(--n-experts > 0, e.g. --model moe-debug)")
        return
    if m.n_experts < 0:
        raise ConfigError(f"--n-experts must be >= 0 (0 = dense model), got {m.n_experts}")
    if not 1 <= m.top_k <= m.n_experts:
        raise ConfigError(f"--top-k {m.top_k} must be in [1, --n-experts {m.n_experts}]")
    if p.ep < 1 or m.n_experts % p.ep:
        raise ConfigError(f"--n-experts {m.n_experts} is not divisible by --ep {p.ep}")
    if p.dp_shard > 0 and p.dp_shard % p.ep:
        raise ConfigError(f"--ep {p.ep} must divide --dp-shard {p.dp_shard} "
                          "(expert parallel borrows data-parallel shard ranks)")
    if p.etp not in (1, p.tp):
        raise ConfigError(f"--etp {p.etp} must be 1 or --tp {p.tp}")
    hidden = m.moe_hidden_dim or 0
    if hidden < 0 or hidden % p.tp or not 0 <= m.n_dense_layers <= m.n_layers:
        raise ConfigError(f"--moe-hidden-dim {m.moe_hidden_dim} must be >= 0 and divisible "
                          f"by --tp {p.tp}; --n-dense-layers {m.n_dense_layers} must be in "
                          f"[0, --n-layers {m.n_layers}]")
    if min(m.n_shared_experts, m.load_balance_coeff, m.aux_loss_coeff) < 0:
        raise ConfigError("--n-shared-experts, --load-balance-coeff and --aux-loss-coeff "
                          "must be >= 0")


def _validate_numbers(cfg: JobConfig) -> None:
    """Values that argparse accepts (nan, negatives, empty strings) but no run can use."""
    o, d, c = cfg.optim, cfg.data, cfg.checkpoint
    if not (math.isfinite(o.lr) and o.lr > 0):
        raise ConfigError(f"--lr must be a finite number > 0, got {o.lr}")
    if math.isnan(o.max_grad_norm):
        raise ConfigError("--max-grad-norm must be a number (<= 0 disables clipping), got nan")
    if not c.sigterm_grace_s >= 0:  # also rejects nan
        raise ConfigError(f"--sigterm-grace-s must be >= 0, got {c.sigterm_grace_s}")
    if d.hf_limit < 0:
        raise ConfigError(f"--hf-limit must be >= 0 (0 = all rows), got {d.hf_limit}")
    for name, value in (("--dataset", d.dataset), ("--tokenizer-name", d.tokenizer_name),
                        ("--outdir", cfg.output.outdir), ("--resume", c.resume)):
        if value is not None and not value.strip():
            raise ConfigError(f"{name} must not be empty")


def _validate_eval(e: EvalConfig) -> None:
    if not 0.0 <= e.val_fraction < 1.0:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {e.val_fraction}")
    if e.val_fraction and e.val_dataset is not None:
        raise ConfigError("--val-dataset and --val-fraction exclude each other; pick one")
    if e.eval_every < 0 or e.eval_steps < 1:
        raise ConfigError(f"--eval-every must be >= 0 and --eval-steps >= 1, got "
                          f"{e.eval_every} and {e.eval_steps}")
    if e.eval_every and not (e.val_fraction or e.val_dataset):
        raise ConfigError("--eval-every needs validation data: --val-dataset or --val-fraction")


def validate(cfg: JobConfig) -> None:
    """Checks that need no process group: shapes, divisibility by tp, sequence limits."""
    m, p, d, t = cfg.model, cfg.parallel, cfg.data, cfg.train
    hf = m.model is not None and is_hf_model(m.model)
    positive = {"--dim": m.dim, "--n-layers": m.n_layers, "--n-heads": m.n_heads,
                "--n-kv-heads": m.n_kv_heads, "--tp": p.tp, "--dp-replicate": p.dp_replicate,
                "--batch-size": t.batch_size, "--seq-len": d.seq_len,
                "--loss-chunk-size": cfg.loss.loss_chunk_size,
                "--grad-accum-steps": t.grad_accum_steps,
                "--keep-checkpoints": cfg.checkpoint.keep_checkpoints,
                "--multiple-of": m.multiple_of, "--vocab-size": m.vocab_size,
                "--epochs": t.epochs, "--max-skipped-steps": t.max_skipped_steps}
    if m.hidden_dim is not None:
        positive["--hidden-dim"] = m.hidden_dim
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    _validate_numbers(cfg)
    if p.dp_shard == 0 or p.dp_shard < -1:
        raise ConfigError(f"--dp-shard must be >= 1 or -1 (auto), got {p.dp_shard}")
    if t.max_steps is not None and t.max_steps < 1:
        raise ConfigError(f"--max-steps must be >= 1, got {t.max_steps}")
    if d.num_workers < 0:
        raise ConfigError(f"--num-workers must be >= 0, got {d.num_workers}")
    if not t.comm_timeout_s > 0:
        raise ConfigError(f"--comm-timeout-s must be > 0, got {t.comm_timeout_s}")
    if not 0.0 < p.act_mem_budget <= 1.0:
        raise ConfigError(f"--act-mem-budget must be in (0, 1], got {p.act_mem_budget}")
    o = cfg.optim
    if o.warmup_steps < 0 or cfg.checkpoint.checkpoint_interval < 0:
        raise ConfigError("--warmup-steps and --checkpoint-interval must be >= 0")
    if not 0.0 <= o.min_lr_ratio <= 1.0 or not 0.0 < o.decay_fraction <= 1.0:
        raise ConfigError(f"--min-lr-ratio must be in [0, 1] and --decay-fraction in (0, 1], "
                          f"got {o.min_lr_ratio} and {o.decay_fraction}")
    if d.seq_len > m.max_seq_len:
        raise ConfigError(f"--seq-len {d.seq_len} exceeds --max-seq-len {m.max_seq_len}")
    _validate_output(cfg.output)
    _validate_eval(cfg.eval)
    if d.streaming and (t.max_steps is None or cfg.eval.val_fraction
                        or d.dataset == "random" or d.num_workers):
        raise ConfigError("--streaming needs --max-steps (a stream has no epoch length) and "
                          "text data; it excludes --val-fraction (use --val-dataset) and "
                          "--num-workers")
    if d.dataset == "random" and cfg.eval.val_dataset is not None:
        raise ConfigError("--val-dataset needs a text --dataset (random data has no tokenizer; "
                          "use --val-fraction)")
    _validate_moe(m, p)
    from loom.parallel.pipeline_plan import validate_pipeline  # it imports this module

    validate_pipeline(cfg)
    if hf and p.data_parallel != "fsdp2":
        raise ConfigError(f"--data-parallel {p.data_parallel} needs loom's own model, not the "
                          f"Hugging Face model {m.model} (use fsdp2)")
    if hf:
        return
    if m.dim % m.n_heads:
        raise ConfigError(f"--dim {m.dim} is not divisible by --n-heads {m.n_heads}")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"--n-kv-heads {m.n_kv_heads} does not divide --n-heads {m.n_heads}")
    if m.n_heads % p.tp:
        raise ConfigError(f"--n-heads {m.n_heads} is not divisible by --tp {p.tp}")
    if m.n_kv_heads % p.tp:
        raise ConfigError(f"--n-kv-heads {m.n_kv_heads} is not divisible by --tp {p.tp}")
    if d.seq_len % p.tp:
        raise ConfigError(f"--seq-len {d.seq_len} is not divisible by --tp {p.tp} "
                          "(sequence parallel splits the sequence across tp ranks)")
