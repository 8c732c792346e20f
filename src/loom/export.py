"""`loom export`: a checkpoint's model as safetensors in Hugging Face Llama layout.

loom's RoPE rotates interleaved channel pairs (2i, 2i+1); Hugging Face Llama rotates the
two halves of each head (i, i + d/2). The q and k projections' rows are permuted per head
so that the exported model computes the same logits.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from loom.checkpoint_format import DATA_FILE, TensorReader
from loom.checkpoint_trust import UnusableCheckpoint, read_loop, verify_checkpoint
from loom.config import ConfigError
from loom.data.tokenizers import SHIPPED_FLAG, load_tokenizer, save_tokenizer, tokenizer_name
from loom.models.llama import ModelArgs, Transformer
from loom.preflight import check_host_fits
from loom.safe_io import read_json_capped, write_text_atomic

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KINDS = {"moe": "a mixture-of-experts model", "hf": "the Hugging Face model"}


def interleaved_to_halves(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's output rows from pairs (2i, 2i+1) to halves (i, i + d/2)."""
    out_dim, in_dim = weight.shape
    head_dim = out_dim // n_heads
    return (weight.view(n_heads, head_dim // 2, 2, in_dim).transpose(1, 2)
            .reshape(out_dim, in_dim))


def hf_state_dict(model_sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Rename (and for q/k permute) loom's parameters into transformers' LlamaForCausalLM."""
    out = {"model.embed_tokens.weight": model_sd["tok_embeddings.weight"],
           "model.norm.weight": model_sd["norm.weight"],
           "lm_head.weight": model_sd["output.weight"]}
    names = {"attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
             "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    for i in range(args.n_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        for ours, theirs in names.items():
            out[f"{dst}{theirs}.weight"] = model_sd[f"{src}{ours}.weight"]
        out[f"{dst}self_attn.q_proj.weight"] = interleaved_to_halves(
            model_sd[f"{src}attention.wq.weight"], args.n_heads)
        out[f"{dst}self_attn.k_proj.weight"] = interleaved_to_halves(
            model_sd[f"{src}attention.wk.weight"], args.n_kv_heads)
    return out


def hf_config(args: ModelArgs, dtype: str) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim,
            "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
            "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta, "max_position_embeddings": args.max_seq_len,
            "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
            "mlp_bias": False, "torch_dtype": "float32" if dtype == "fp32" else "bfloat16"}


HOST_COPIES = 3
"""Copies of the weights export and generate hold at once (loaded, converted or a second
model, serialised), for the memory check."""


def check_model_bytes(args: ModelArgs, checkpoint: Path, manifest: dict[str, Any]) -> None:
    """The model that `model_args` describe is no larger than the checkpoint's data files
    (which hold its fp32 weights), and fits in memory with its buffers, before anything is
    allocated: a crafted `max_seq_len` or `dim` stops here in one line."""
    with torch.device("meta"):
        model = Transformer(args)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    stored = sum(r["bytes"] for name, r in manifest["files"].items() if DATA_FILE.match(name))
    if weights > stored:
        raise UnusableCheckpoint(f"checkpoint {checkpoint} is unsafe: loop.json model_args "
                                 f"describe {weights:,} bytes of weights, its data files hold "
                                 f"{stored:,}")
    check_host_fits(HOST_COPIES * weights + buffers, f"the model of {checkpoint}")


def load_model_state(checkpoint: Path) -> tuple[dict[str, torch.Tensor], ModelArgs]:
    """Verify a checkpoint and read its full (unsharded) model in this one process."""
    manifest = verify_checkpoint(checkpoint)
    loop = read_loop(checkpoint)
    kind, name = loop["architecture"].get("kind"), loop["architecture"].get("model")
    if kind != "dense":
        held = KINDS.get(kind, f"a {kind} model") + (f" {name}" if name else "")
        raise ConfigError(f"cannot export {checkpoint}: it holds {held}; loom export writes "
                          "dense loom models only; nothing was written")
    args = ModelArgs(**loop["model_args"])
    check_model_bytes(args, checkpoint, manifest)
    state = {"model": Transformer(args).state_dict()}
    try:
        dcp.load(state, storage_reader=TensorReader(checkpoint), no_dist=True)
    except CheckpointException as e:  # a BaseException: names the first rank's failure
        failure = next(iter(e.failures.values()), (e,))[0]
        reason = f"{type(failure).__name__}: {failure}"
        raise UnusableCheckpoint(f"checkpoint {checkpoint} cannot be loaded: "
                                 f"{' '.join(reason.split())[:300]}") from None
    return state["model"], args


def run_tokenizer(checkpoint: Path) -> str | None:
    """The tokenizer of the run that saved `checkpoint`, from its run folder's config.json
    (None: the shipped one)."""
    settings = run_config(checkpoint)
    return tokenizer_name(settings.get("data", {}).get("tokenizer_name"),
                          settings.get("model", {}).get("model"))


def run_config(checkpoint: Path) -> dict[str, Any]:
    """The `data` and `model` tables of the config.json of the run that saved `checkpoint`
    ({} where there is none); the names in them must be strings or null."""
    config = checkpoint.parent.parent / "config.json"
    if not config.exists() and not config.is_symlink():
        return {}
    try:
        settings = read_json_capped(config)
        tables = {k: settings.get(k, {}) for k in ("data", "model")}
        if not all(isinstance(t, dict) for t in tables.values()) or not all(
                isinstance(t.get(k), str | None) for t, k in
                ((tables["data"], "tokenizer_name"), (tables["model"], "model"))):
            raise ValueError("tokenizer_name or model is not a name")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{config} is unusable ({e}); nothing was written") from None
    return tables


def export(checkpoint: Path, outdir: Path, dtype: str = "fp32",
           trust_remote_code: bool = False) -> str:
    """Write the model, and the run's tokenizer when the embedding covers it; returns what
    was written, for the one line `loom export` prints."""
    from safetensors.torch import save_file

    model_sd, args = load_model_state(checkpoint)
    tensors = {name: value.to(DTYPES[dtype]).contiguous()
               for name, value in hf_state_dict(model_sd, args).items()}
    outdir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(outdir / "model.safetensors"), metadata={"format": "pt"})
    write_text_atomic(outdir / "config.json", json.dumps(hf_config(args, dtype), indent=2) + "\n")
    tokenizer = run_tokenizer(checkpoint)
    size = load_tokenizer(tokenizer, trust_remote_code).size
    if size > args.vocab_size:  # e.g. a --dataset random run with a small --vocab-size
        return (f"model only: its {args.vocab_size}-row embedding is smaller than tokenizer "
                f"{tokenizer or SHIPPED_FLAG} ({size} tokens)")
    save_tokenizer(tokenizer, outdir, trust_remote_code)
    return f"model and tokenizer {tokenizer or SHIPPED_FLAG}"


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="loom export",
                                     description="write a checkpoint as a HF Llama model")
    parser.add_argument("checkpoint", type=Path, help="a checkpoints/step-N folder")
    parser.add_argument("outdir", type=Path, help="folder for model.safetensors + config.json")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--verbose", action="store_true", help="show upstream notices")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the code the run's tokenizer folder or repo ships")
    opts = parser.parse_args(list(argv))
    if not opts.verbose:  # DCP's note that it loads in one process: exactly what export does
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
    if not (opts.checkpoint / "loop.json").is_file():
        print(f"error: {opts.checkpoint} is not a loom checkpoint folder", file=sys.stderr)
        return 2
    try:
        written = export(opts.checkpoint, opts.outdir, opts.dtype, opts.trust_remote_code)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {opts.checkpoint} -> {opts.outdir} ({written})")
    return 0
