"""Llama weights and shape to and from transformers' `LlamaForCausalLM`.

loom's RoPE rotates interleaved channel pairs (2i, 2i+1); transformers rotates the two
halves of each head (i, i + d/2). The q and k projections' rows (and a per-head q/k norm's
weight) are permuted per head on the way in and back on the way out: a pure reordering, so
a round trip gives every tensor back bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch

from loom.models.llama.model import ModelArgs

Source = tuple[list[str], Callable[..., torch.Tensor]]
"""Hugging Face tensor names and the function of them that gives loom's tensor."""

SUPPORTED_ROPE = ("default", "llama3")


def halves_to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Each head's rows from halves order (i, i + d/2) to pairs order (2i, 2i+1); a 1-D
    per-head weight (q/k norm) is one head of width d."""
    flat = weight.dim() == 1
    w = weight.reshape(-1, 1) if flat else weight
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    out = w.reshape(n_heads, 2, head_dim // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)
    return out.reshape(-1) if flat else out


def interleaved_to_halves(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `halves_to_interleaved`."""
    flat = weight.dim() == 1
    w = weight.reshape(-1, 1) if flat else weight
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    out = w.reshape(n_heads, head_dim // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)
    return out.reshape(-1) if flat else out


def same(t: torch.Tensor) -> torch.Tensor:
    return t


def rope_fields(c: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings from transformers 5's `rope_parameters` or 4's `rope_theta` and
    `rope_scaling`; a scaling loom does not implement is refused by name."""
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = params.get("rope_theta", c.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in SUPPORTED_ROPE:
        raise ValueError(f"RoPE scaling {kind!r} (loom implements {', '.join(SUPPORTED_ROPE)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor below 1")
    fields = {"rope_theta": float(theta)}
    if kind == "llama3":
        fields.update(rope_factor=float(params["factor"]),
                      rope_low_freq_factor=float(params["low_freq_factor"]),
                      rope_high_freq_factor=float(params["high_freq_factor"]),
                      rope_original_max_seq_len=int(params["original_max_position_embeddings"]))
    return fields


def rope_config(args: ModelArgs) -> dict[str, Any]:
    """The exported config's RoPE keys (transformers 5 reads the legacy ones too)."""
    out: dict[str, Any] = {"rope_theta": args.rope_theta}
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_factor != 1.0:
        params = {"rope_type": "llama3", "rope_theta": args.rope_theta,
                  "factor": args.rope_factor, "low_freq_factor": args.rope_low_freq_factor,
                  "high_freq_factor": args.rope_high_freq_factor,
                  "original_max_position_embeddings": args.rope_original_max_seq_len}
        out["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    out["rope_parameters"] = params
    return out


def refuse(c: dict[str, Any], settings: dict[str, Any]) -> None:
    """Raise ValueError naming the first of `settings` whose value in `c` is not the one
    loom's model reproduces."""
    for key, expected in settings.items():
        if c.get(key, expected) != expected:
            raise ValueError(f"{key} = {c[key]!r}")


def dense_fields(c: dict[str, Any]) -> dict[str, Any]:
    """loom's model fields for a Llama-shaped config.json."""
    refuse(c, {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
               "use_sliding_window": False, "pretraining_tp": 1})
    heads = int(c["num_attention_heads"])
    fields = {"dim": int(c["hidden_size"]), "n_layers": int(c["num_hidden_layers"]),
              "n_heads": heads, "n_kv_heads": int(c.get("num_key_value_heads") or heads),
              "hidden_dim": int(c["intermediate_size"]), "vocab_size": int(c["vocab_size"]),
              "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
              "max_seq_len": int(c.get("max_position_embeddings", 2048)),
              "head_dim": int(c.get("head_dim") or int(c["hidden_size"]) // heads),
              "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
              "ffn_dim_multiplier": None, "n_experts": 0}
    return {**fields, **rope_fields(c)}


def attention_sources(i: int, args: ModelArgs) -> dict[str, Source]:
    src, dst = f"model.layers.{i}.self_attn.", f"layers.{i}.attention."

    def permuted(n_heads: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: halves_to_interleaved(t, n_heads)

    out: dict[str, Source] = {
        f"{dst}wq.weight": ([f"{src}q_proj.weight"], permuted(args.n_heads)),
        f"{dst}wk.weight": ([f"{src}k_proj.weight"], permuted(args.n_kv_heads)),
        f"{dst}wv.weight": ([f"{src}v_proj.weight"], same),
        f"{dst}wo.weight": ([f"{src}o_proj.weight"], same)}
    if args.qk_norm:
        out[f"{dst}q_norm.weight"] = ([f"{src}q_norm.weight"], permuted(1))
        out[f"{dst}k_norm.weight"] = ([f"{src}k_norm.weight"], permuted(1))
    return out


def block_sources(i: int, args: ModelArgs) -> dict[str, Source]:
    """A block's norms and attention (its feed-forward is the caller's)."""
    src, dst = f"model.layers.{i}.", f"layers.{i}."
    return {f"{dst}attention_norm.weight": ([f"{src}input_layernorm.weight"], same),
            f"{dst}ffn_norm.weight": ([f"{src}post_attention_layernorm.weight"], same),
            **attention_sources(i, args)}


def dense_ffn_sources(i: int) -> dict[str, Source]:
    src, dst = f"model.layers.{i}.mlp.", f"layers.{i}.feed_forward."
    return {f"{dst}w1.weight": ([f"{src}gate_proj.weight"], same),
            f"{dst}w2.weight": ([f"{src}down_proj.weight"], same),
            f"{dst}w3.weight": ([f"{src}up_proj.weight"], same)}


def outer_sources(args: ModelArgs) -> dict[str, Source]:
    head = "model.embed_tokens.weight" if args.tie_embeddings else "lm_head.weight"
    return {"tok_embeddings.weight": (["model.embed_tokens.weight"], same),
            "norm.weight": (["model.norm.weight"], same),
            "output.weight": ([head], same)}


def dense_sources(args: ModelArgs) -> dict[str, Source]:
    out = outer_sources(args)
    for i in range(args.n_layers):
        out.update(block_sources(i, args))
        out.update(dense_ffn_sources(i))
    return out


def exported(sources: dict[str, Source], args: ModelArgs,
             read: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Invert the sources: each loom tensor, read once, un-permuted to its Hugging Face name,
    or unstacked into several (experts); a tied head is written once, as the embedding."""
    for ours, (theirs, _) in sources.items():
        if ours == "output.weight" and args.tie_embeddings:
            continue
        tensor = read(ours)
        if len(theirs) > 1:
            yield from zip(theirs, tensor.unbind(0), strict=True)
            continue
        if ours.endswith(("attention.wq.weight", "attention.wk.weight")):
            heads = args.n_heads if ours.endswith("wq.weight") else args.n_kv_heads
            tensor = interleaved_to_halves(tensor, heads)
        elif ours.endswith(("q_norm.weight", "k_norm.weight")):
            tensor = interleaved_to_halves(tensor, 1)
        yield theirs[0], tensor


def settle_tie(args: ModelArgs, read: Callable[[str], torch.Tensor]) -> ModelArgs:
    """Tied only while training left the two copies equal; else exported untied."""
    if args.tie_embeddings and not torch.equal(read("tok_embeddings.weight"),
                                               read("output.weight")):
        return replace(args, tie_embeddings=False)
    return args


def dense_config(args: ModelArgs, dtype: str) -> dict[str, Any]:
    return {"hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim,
            "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
            "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
            "max_position_embeddings": args.max_seq_len, "hidden_act": "silu",
            "tie_word_embeddings": args.tie_embeddings, "attention_bias": False,
            "dtype": "float32" if dtype == "fp32" else "bfloat16", **rope_config(args)}


class LlamaAdapter:
    """`LlamaForCausalLM` (Llama 2, 3, 3.1 with its RoPE scaling, 3.2 with tied embeddings)."""

    architectures = ("LlamaForCausalLM",)

    def fields_from_hf(self, c: dict[str, Any]) -> dict[str, Any]:
        return {**dense_fields(c), "qk_norm": False}

    def sources(self, args: ModelArgs) -> dict[str, Source]:
        return dense_sources(args)

    def export_refusal(self, args: ModelArgs) -> str | None:
        if getattr(args, "n_experts", 0):
            return "a mixture of experts"
        if args.qk_norm:
            return "q/k norm (--qk-norm)"
        return None

    def settle(self, args: ModelArgs, read: Callable[[str], torch.Tensor]) -> ModelArgs:
        return settle_tie(args, read)

    def hf_config(self, args: ModelArgs, dtype: str) -> dict[str, Any]:
        return {"architectures": list(self.architectures), "model_type": "llama",
                "mlp_bias": False, **dense_config(args, dtype)}

    def hf_tensors(self, args: ModelArgs, read: Callable[[str], torch.Tensor]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        return exported(self.sources(args), args, read)
