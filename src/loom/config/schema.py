"""The job's flags, one frozen dataclass per group, each field declared by `flag()` (help,
aliases, environment variable, range: `loom.config.declare`), from which the parser, the
environment source and the range checks are generated; `loom.config.job` composes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from loom.config.checkpointing import CheckpointConfig  # noqa: F401  (a section, declared apart)
from loom.config.declare import (
    COUNT_MAX,
    DEGREE,
    FOREVER_S,
    INT64_MAX,
    SIZE,
    VAL_SETS_MAX,
    flag,
)
from loom.config.families import flat_values, replace_values
from loom.config.optim import OptimConfig  # noqa: F401  (a section of the job, declared apart)
from loom.config.presets import is_hf_model

T = TypeVar("T")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = flag(None, "preset, alias, Hugging Face repo id or local HF folder",
                             type=str)
    dim: int = flag(256, "model width", **SIZE)
    n_layers: int = flag(32, "number of transformer blocks", **DEGREE)
    n_heads: int = flag(32, "attention heads", **DEGREE)
    n_kv_heads: int = flag(4, "key/value heads (grouped-query attention); divides n-heads",
                           **DEGREE)
    multiple_of: int = flag(360, "round the SwiGLU hidden dim up to a multiple of this", **SIZE)
    ffn_dim_multiplier: float | None = flag(None, "scale the SwiGLU hidden dim", type=float,
                                            gt=0, le=100)
    hidden_dim: int | None = flag(None, "SwiGLU hidden dim; bypasses the derivation", type=int,
                                  **SIZE)
    rope_theta: float = flag(10000.0, "RoPE base frequency", gt=0)
    norm_eps: float = flag(1e-5, "RMSNorm epsilon", gt=0, lt=1)
    vocab_size: int = flag(32000, "vocabulary size (replaced by the tokenizer's size)", **SIZE)
    max_seq_len: int = flag(32768, "RoPE table size; seq-len must not exceed it", **SIZE)
    trust_remote_code: bool = flag(False, "Hugging Face --model: run the modelling code the "
                                   "repo ships (only for repos you trust)")
    model_impl: str = flag(
        "auto", "Hugging Face --model: loom's native family for its architecture (every "
        "parallelism applies) or transformers' own module (FSDP/HSDP only); auto: native "
        "where a family serves the architecture and every feature of its config, else "
        "transformers'", choices=("auto", "native", "transformers"))
    model_impl_reason: str | None = flag(None, "why --model-impl resolved as it did (set by "
                                         "loom, recorded in config.json)", type=str,
                                         hidden=True)
    family: str | None = flag(None, "model family (default: llama, or moe when --n-experts > "
                              "0; a Hugging Face import sets it)", type=str)
    tie_embeddings: bool = flag(False, "the source ties output and embedding weights (trained "
                                "as two tensors that start equal; export ties them again): "
                                "read from a Hugging Face folder or a preset; a fresh "
                                "model's two tensors start apart, so the flag is refused")
    family_args: tuple[Any, ...] = field(default=(), metadata={"family_args": True})
    """The families' own flags (`loom.config.families`), one frozen dataclass per group,
    each held only where it differs from its defaults: not a flag itself. Read one with
    `flags_of`, all of them flat with `values`; set them with `with_values`."""

    def flags_of(self, group: type[T]) -> T:
        """The values of one family's flag group (its defaults where none was set)."""
        return next((a for a in self.family_args if type(a) is group), None) or group()

    def values(self) -> dict[str, Any]:
        """Every model flag by name, the families' included: what config.json, a --config
        file and `--print-config` hold under [model], and what a family's arguments are
        filled from."""
        return flat_values(self)

    def with_values(self, **values: Any) -> ModelConfig:
        """This config with model flags replaced by name, shared or a registered family's
        (an unknown name is a TypeError, as `dataclasses.replace` raises)."""
        return replace_values(self, values)

    @property
    def from_hub_format(self) -> bool:
        """--model names a Hugging Face repo or folder (not a preset): weights and shape come
        from it, natively or through transformers."""
        return self.model is not None and is_hf_model(self.model)

    @property
    def runs_transformers(self) -> bool:
        """The model is transformers' own module (resolved by `loom.trainer.resolve.resolve_model`;
        `--model-impl transformers` decides it before then)."""
        return self.from_hub_format and self.model_impl == "transformers"


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = flag(1, "tensor (+ sequence) parallel degree", **DEGREE)
    dp_replicate: int = flag(1, "replicated data-parallel degree (HSDP's outer dim)", **DEGREE)
    dp_shard: int = flag(-1, "sharded data-parallel degree; -1 = all remaining ranks",
                         ge=-1, le=COUNT_MAX)
    reshard_after_forward: str = flag(
        "always", "free gathered parameters after forward (always = ZeRO-3, never = ZeRO-2)",
        choices=("always", "never"), const="always")
    sharding_strategy: str | None = flag(None, "deprecated; use --reshard-after-forward",
                                         type=str, hidden=True)
    activation_checkpoint: str = flag(
        "none", "recompute activations in backward: block (all of each block), selective "
        "(each block's attention), op (each block's cheap ops; attention and every other "
        "matmul saved)", aliases=("--ac",),
        choices=("none", "block", "full", "selective", "op"))
    compile: bool = flag(False, "torch.compile each transformer block")
    compile_mode: str = flag("default", "torch.compile mode",
                             choices=("default", "reduce-overhead", "max-autotune"))
    act_mem_budget: float = flag(1.0, "activation memory budget of the partitioner (--compile)",
                                 gt=0, le=1)
    compile_backend: str = flag(
        "inductor", "torch.compile backend; aot_eager skips code generation (cheap, for tests) "
        "($LOOM_COMPILE_BACKEND)", choices=("inductor", "aot_eager"),
        env="LOOM_COMPILE_BACKEND")
    cuda_graphs: bool = flag(
        False, "replay each compiled single-device step as CUDA graphs (compile's "
        "reduce-overhead mode); refused in one line where they cannot apply")
    dtype: str = flag("auto", "compute dtype: bf16 mixed precision (fp32 master weights), fp32, "
                      "or auto (bf16 on GPUs and native-bf16 CPUs, else fp32)",
                      choices=("auto", "bf16", "fp32"))
    reduce_dtype: str = flag("fp32", "gradient reduction dtype under mixed precision "
                             "($LOOM_REDUCE_DTYPE)", choices=("fp32", "bf16"),
                             env="LOOM_REDUCE_DTYPE")
    grad_divide_factor: bool = flag(
        True, "sum gradients in the collective and divide once by the dp size "
        "($LOOM_FSDP_DIVIDE_FACTOR=0 turns it off)", hidden=True,
        env="LOOM_FSDP_DIVIDE_FACTOR")
    gloo_collectives: str = flag(
        "pairwise", "FSDP2's all-gather and reduce-scatter on gloo: point-to-point exchanges "
        "(2-3x faster on CPU) or gloo's own ($LOOM_GLOO_COLLECTIVES)",
        choices=("pairwise", "native"), hidden=True, env="LOOM_GLOO_COLLECTIVES")
    data_parallel: str = flag(
        "fsdp2", "data-parallel wrapper: FSDP2 units, or SimpleFSDP (parameters gathered by "
        "DTensor redistribution on access; with --compile the whole model is one graph)",
        choices=("fsdp2", "simple-fsdp"))
    single_device: str = flag(
        "plain", "at world size 1: the model unwrapped (bf16 by autocast; under --compile one "
        "graph), or FSDP2 as at N ranks ($LOOM_SINGLE_DEVICE)", choices=("plain", "fsdp2"),
        hidden=True, env="LOOM_SINGLE_DEVICE")
    ep: int = flag(1, "expert-parallel degree: spans dp_shard x cp x tp ranks at "
                        "--etp 1, dp_shard x cp at --etp tp (must divide them)", **DEGREE)
    etp: int = flag(1, "expert tensor parallel: 1 (tp ranks split the tokens) or tp "
                    "(each expert split across tp too)", **DEGREE)
    cp: int = flag(1, "context-parallel degree: each sequence is split across this many ranks "
                   "(two mirrored chunks each, so causal attention work is even)", **DEGREE)
    pp: int = flag(1, "pipeline-parallel degree (the outermost mesh dim: ranks hold "
                   "consecutive layers)", **DEGREE)
    pp_schedule: str = flag("1f1b", "pipeline schedule (interleaved-1f1b: looped stages; "
                            "zero-bubble, dualpipev: V-shaped, split backward, see "
                            "docs/parallelism.md)",
                            choices=("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble",
                                     "dualpipev"))
    pp_microbatches: int = flag(0, "pipeline micro-batches per --batch-size batch (must "
                                "divide it); 0 = the fewest keeping the bubble under a quarter",
                                le=COUNT_MAX)
    pp_stages_per_rank: int = flag(0, "pipeline stages each rank holds; 0 = the schedule's "
                                   "(1, or 2 for interleaved-1f1b)", le=COUNT_MAX)
    float8: str = flag(
        "off", "float8 matmuls in the blocks' linear layers through torchao (pip install "
        "'loom[float8]'; compute capability >= 8.9, emulated on CPU): tensorwise scales "
        "(float8 all-gather under FSDP2) or rowwise; the output head and MoE router gates "
        "stay in --dtype", choices=("off", "tensorwise", "rowwise"))
    float8_emulate: bool = flag(
        False, "--float8: run the float8 casts with high-precision matmuls (numerics of "
        "float8, speed of none; automatic on CPU, for testing elsewhere)")
    ft_replica_groups: int = flag(
        1, "fault-tolerant replica groups on torchft (pip install 'loom[ft]'): the job is N "
        "groups, each its own launch of any layout but --dp-replicate, averaging over the "
        "groups present; start them with loom launch --ft-replica-groups N "
        "(docs/faults.md)", **DEGREE)
    ft: str = flag("average", "--ft-replica-groups' algorithm: average (each step's gradients, "
                   "as HSDP) or diloco (groups train --sync-every steps alone, then average "
                   "their weights' change: torchft's DiLoCo)", choices=("average", "diloco"))
    sync_every: int = flag(10, "--ft diloco: inner steps between syncs (H)", **DEGREE)
    outer_lr: float = flag(0.7, "--ft diloco: the outer Nesterov SGD's lr", gt=0, le=10)
    outer_momentum: float = flag(0.9, "--ft diloco: the outer SGD's momentum", lt=1)
    ft_group: int = flag(0, "this process's replica group (set by loom launch)", le=COUNT_MAX,
                         hidden=True, env="LOOM_FT_GROUP")
    ft_lighthouse: str | None = flag(None, "torchft's lighthouse address (set by loom launch)",
                                     type=str, hidden=True, env="LOOM_FT_LIGHTHOUSE")
    ft_join_timeout_s: float = flag(30.0, "the lighthouse's join timeout: ranks wait longer "
                                    "for a quorum (set by loom launch)", gt=0, le=86_400,
                                    hidden=True, env="LOOM_FT_JOIN_TIMEOUT_S")


@dataclass(frozen=True)
class LoraConfig:
    lora_rank: int = flag(0, "LoRA: train rank-r adapters on the targeted linears and freeze "
                          "every other weight (0 = off: full fine-tuning)", le=COUNT_MAX)
    lora_alpha: float = flag(16.0, "LoRA: the adapters' output is scaled by alpha / rank", gt=0)
    lora_dropout: float = flag(0.0, "LoRA: dropout on the adapters' input (training only)", lt=1)
    lora_targets: str | None = flag(
        None, "LoRA: comma-separated linears within each block, by the family's module "
        "names; a name without a dot keeps the previous one's parent (attention.wq,wk,wv,wo); "
        "default: the family's (Llama: every attention and MLP projection)", type=str)
    lora_base: str | None = flag(
        None, "LoRA: the base the adapters train on, as loom records it: sha256:<digest> of "
        "the --model folder's weight files, or init:<seed> (set by loom; given, the base must "
        "be that one)", type=str, hidden=True)


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = flag(5, "passes over the dataset", ge=1)
    batch_size: int = flag(1, "samples per data-parallel rank per step", **SIZE)
    seed: int = flag(0, "seed for weights and data order (identical commands reproduce)",
                     le=INT64_MAX)
    max_steps: int | None = flag(None, "stop after this many optimizer steps", type=int, ge=1)
    grad_accum_steps: int = flag(1, "micro-batches accumulated per optimizer step", ge=1)
    accum_reduce: str = flag(
        "step", "--grad-accum-steps: reduce gradients once a step, holding a full-size "
        "gradient of every weight until the last micro-batch (step), or after every "
        "micro-batch, keeping them sharded (micro-batch)", choices=("step", "micro-batch"))
    skip_nonfinite: bool = flag(False, "skip a step whose loss or gradient is not finite "
                                "(default: stop the run)")
    max_skipped_steps: int = flag(10, "--skip-nonfinite: stop after this many consecutive "
                                  "skipped steps", ge=1)
    comm_timeout_s: float = flag(600.0, "end the job when a collective or a whole step "
                                 "makes no progress for this long (a stalled or dead rank)",
                                 gt=0, le=FOREVER_S)
    gc_every: int = flag(50, "Python's garbage collector: setup's objects frozen, automatic "
                         "collection off, a young-generation collection every N steps "
                         "(0: Python's own schedule)")
    host_memory: str = flag(
        "retain", "CPU training: keep freed host memory for the next step (glibc malloc "
        "without mmap or trimming: faster steps, a higher peak RSS) or release it "
        "(glibc's default)", choices=("retain", "release"))


@dataclass(frozen=True)
class LossConfig:
    loss_impl: str = flag("eager", "cross-entropy implementation", choices=(
        "eager", "chunked", "chunked-backward", "compiled", "fused-linear", "loss-parallel"))
    loss_chunk_size: int = flag(1024, "row chunk of the chunked and fused-linear losses", **SIZE)
    debug_logits: bool = flag(False, "log the first step's finite-logit count and max |logit| "
                              "(materialises the full logits; $LOOM_DEBUG_LOGITS=1)", hidden=True,
                              env="LOOM_DEBUG_LOGITS")


@dataclass(frozen=True)
class DataConfig:
    dataset: str | None = flag(None, "hub id, local file/folder, or 'random' "
                               "(default: the embedded corpus); a weighted mixture: "
                               "PATH:W,PATH:W,... (windows dealt by a fixed schedule)",
                               type=str)
    mixture_exhausted: str = flag(
        "restart", "--dataset mixture: a source that has given every window is read again "
        "in a new order (restart), ends the epoch (stop), or leaves the mixture to the "
        "others (drop)", choices=("restart", "stop", "drop"))
    tokenizer_name: str | None = flag(None, "hub id or local folder of a tokenizer", type=str)
    hf_split: str = flag("train", "dataset split")
    hf_text_column: str = flag("text", "column holding the text")
    hf_limit: int = flag(0, "keep this many rows, chosen deterministically (0 = all)")
    seq_len: int = flag(1024, "tokens per sample ($SEQ_LEN)", env="SEQ_LEN", **SIZE)
    num_workers: int = flag(0, "data loader worker processes", le=1024)
    hf_limit_seed: int = flag(0, "seed of the --hf-limit subsample ($LOOM_HF_LIMIT_SEED)",
                              hidden=True, env="LOOM_HF_LIMIT_SEED", le=INT64_MAX)
    streaming: bool = flag(False, "read, tokenize and pack documents on the fly, dealt to dp "
                           "ranks (needs --max-steps; resumes at the exact token)")
    cache_dir: str | None = flag(None, "tokenization cache folder ($LOOM_CACHE_DIR; "
                                 "default ~/.cache/loom)", type=str, hidden=True,
                                 env="LOOM_CACHE_DIR")
    doc_mask: bool = flag(False, "attention stays inside each packed document (split at the "
                          "tokenizer's end-of-text) and RoPE positions restart at each")
    """Packing puts several documents in one window; without the mask a token attends to the
    documents before it and its position counts on across them."""


@dataclass(frozen=True)
class EvalConfig:
    val_dataset: tuple[str, ...] = flag(
        (), "validation data: hub id, local file/folder or shard folder (same tokenizer as "
        "--dataset); PATH is the default set (val/loss), NAME=PATH a named one "
        "(val/NAME/loss)", type=str, repeat=True, most=VAL_SETS_MAX)
    val_fraction: float = flag(0.0, "hold out this fraction of --dataset's tokens for "
                               "validation, cut between documents", lt=1)
    eval_every: int = flag(0, "validation loss every N steps (0 = only after the last step)")
    eval_steps: int = flag(8, "global batches per validation (at most the whole set; 0 = the "
                           "whole set; loom eval's default: 0)")
    eval_tasks: str | None = flag(
        None, "lm-evaluation-harness tasks, comma-separated (the eval extra): run after the "
        "last step and every --eval-tasks-every steps, logged as eval/TASK/METRIC; "
        "`loom eval CKPT --tasks` runs them on a checkpoint", aliases=("--tasks",), type=str)
    eval_tasks_every: int = flag(0, "--eval-tasks every N steps (0 = only after the last step)")
    eval_tasks_include: str | None = flag(
        None, "a folder or YAML file of local lm-evaluation-harness task configs for "
        "--eval-tasks", aliases=("--tasks-include",), type=str)
    eval_tasks_limit: int = flag(0, "--eval-tasks: at most N documents of each task (0 = all)",
                                 aliases=("--tasks-limit",))


@dataclass(frozen=True)
class OutputConfig:
    outdir: str | None = flag(None, "run folder (default: outputs/<timestamp>)", type=str)
    overwrite: bool = flag(False, "move a previous run in --outdir aside and start anew")
    adopt_outdir: bool = flag(False, "use a non-empty --outdir that is not a loom run folder "
                              "(no .loom-run marker) as the run folder")
    profile: bool = flag(False, "torch profiler trace in the run folder")
    profile_rank0_only: bool = flag(False, "--profile: only rank 0 records (default: every "
                                    "rank writes its own trace)")
    profile_wait: int = flag(2, "--profile: steps skipped before recording")
    profile_warmup: int = flag(2, "--profile: steps recorded and discarded (tracer warm-up)")
    profile_active: int = flag(3, "--profile: steps recorded into each trace", ge=1)
    profile_repeat: int = flag(1, "--profile: wait/warmup/active cycles, one trace each "
                               "(0 = until the run ends)")
    profile_memory: bool = flag(False, "--profile: record tensor allocations and frees")
    memory_snapshot: int = flag(
        0, "CUDA: record the caching allocator's history from the start and write "
        "memory-snapshot-rank<r>.pickle to the run folder after N steps (bare flag: 3; 0 = "
        "off); an out-of-memory error writes memory-oom-rank<r>.pickle either way",
        const=3)
    profile_shapes: bool = flag(False, "--profile: record operator input shapes")
    profile_stack: bool = flag(False, "--profile: record the Python stack of each operator")
    profile_flops: bool = flag(False, "--profile: estimate FLOPs of matmuls and convolutions")
    profile_modules: bool = flag(False, "--profile: record the nn.Module hierarchy of each op")
    pyinstrument_profiler: bool = flag(False, "pyinstrument profile of the run "
                                       "(pip install 'loom[profile]')")
    wandb: bool = flag(False, "log to Weights & Biases (pip install 'loom[wandb]'; "
                       "WANDB_MODE=offline works without an account)")
    tensorboard: bool = flag(False, "write TensorBoard event files of every metrics row to "
                             "<outdir>/tensorboard (pip install 'loom[tensorboard]')")
    log_every: int = flag(0, "progress line every N steps (0 = auto, ~20 lines) ($LOOM_LOG_EVERY)",
                          env="LOOM_LOG_EVERY")
    verbose: bool = flag(False, "show the upstream notices loom hides (docs/troubleshooting.md)")
    metrics: bool = flag(True, "per-step metrics ($LOOM_METRICS=0 turns them off: the "
                         "overhead baseline)", hidden=True, env="LOOM_METRICS")
    health_every: int = flag(-1, "gradient/parameter health statistics every K steps, 0 = off, "
                             "-1 = at the logging steps ($LOOM_HEALTH_EVERY)", hidden=True,
                             env="LOOM_HEALTH_EVERY", ge=-1)
    hist_every: int = flag(0, "histograms every N steps, 0 = off ($LOOM_HIST_EVERY)",
                           hidden=True, env="LOOM_HIST_EVERY")
    hist: str = flag("logits,grads,acts", "which histograms, comma-separated: logits, grads "
                     "(per-layer norms), acts (block outputs), attn (attention outputs), ffn "
                     "(feed-forward / MoE outputs) ($LOOM_HIST)", hidden=True, env="LOOM_HIST")
    hist_bins: int = flag(64, "bins per histogram ($LOOM_HIST_BINS)", hidden=True,
                          env="LOOM_HIST_BINS", **DEGREE)
    hist_samples: int = flag(0, "values per histogram, taken at an even stride from the "
                             "tensor (0 = all) ($LOOM_HIST_SAMPLES)", hidden=True,
                             env="LOOM_HIST_SAMPLES")
    hist_layers: str = flag("all", "blocks whose activations and gradient norms are recorded: "
                            "all, or comma-separated indices ($LOOM_HIST_LAYERS)", hidden=True,
                            env="LOOM_HIST_LAYERS")
    track_logits: bool = flag(False, "per-step logits/max_abs and logits/nonfinite over this "
                              "rank's logits (a forward hook on the output head; absent under "
                              "--loss-impl fused-linear, which never forms them) "
                              "($LOOM_TRACK_LOGITS)", env="LOOM_TRACK_LOGITS")
