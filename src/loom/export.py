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

import torch
import torch.distributed.checkpoint as dcp

from loom.checkpoint_format import TensorReader
from loom.checkpoint_trust import read_loop, verify_checkpoint
from loom.config import ConfigError
from loom.data.tokenizers import SHIPPED_FLAG, load_tokenizer, save_tokenizer, tokenizer_name
from loom.models.llama import ModelArgs, Transformer
from loom.safe_io import write_text_atomic

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


def load_model_state(checkpoint: Path) -> tuple[dict[str, torch.Tensor], ModelArgs]:
    """Verify a checkpoint and read its full (unsharded) model in this one process."""
    verify_checkpoint(checkpoint)
    loop = read_loop(checkpoint)
    kind, name = loop["architecture"].get("kind"), loop["architecture"].get("model")
    if kind != "dense":
        held = KINDS.get(kind, f"a {kind} model") + (f" {name}" if name else "")
        raise ConfigError(f"cannot export {checkpoint}: it holds {held}; loom export writes "
                          "dense loom models only; nothing was written")
    args = ModelArgs(**loop["model_args"])
    state = {"model": Transformer(args).state_dict()}
    dcp.load(state, storage_reader=TensorReader(checkpoint), no_dist=True)
    return state["model"], args


def run_tokenizer(checkpoint: Path) -> str | None:
    """The tokenizer of the run that saved `checkpoint`, from its run folder's config.json
    (None: the shipped one)."""
    config = checkpoint.parent.parent / "config.json"
    settings = json.loads(config.read_text()) if config.is_file() else {}
    return tokenizer_name(settings.get("data", {}).get("tokenizer_name"),
                          settings.get("model", {}).get("model"))


def export(checkpoint: Path, outdir: Path, dtype: str = "fp32") -> str:
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
    size = load_tokenizer(tokenizer).size
    if size > args.vocab_size:  # e.g. a --dataset random run with a small --vocab-size
        return (f"model only: its {args.vocab_size}-row embedding is smaller than tokenizer "
                f"{tokenizer or SHIPPED_FLAG} ({size} tokens)")
    save_tokenizer(tokenizer, outdir)
    return f"model and tokenizer {tokenizer or SHIPPED_FLAG}"


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="loom export",
                                     description="write a checkpoint as a HF Llama model")
    parser.add_argument("checkpoint", type=Path, help="a checkpoints/step-N folder")
    parser.add_argument("outdir", type=Path, help="folder for model.safetensors + config.json")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--verbose", action="store_true", help="show upstream notices")
    opts = parser.parse_args(list(argv))
    if not opts.verbose:  # DCP's note that it loads in one process: exactly what export does
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
    if not (opts.checkpoint / "loop.json").is_file():
        print(f"error: {opts.checkpoint} is not a loom checkpoint folder", file=sys.stderr)
        return 2
    try:
        written = export(opts.checkpoint, opts.outdir, opts.dtype)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {opts.checkpoint} -> {opts.outdir} ({written})")
    return 0
