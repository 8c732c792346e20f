"""DeepSeek-V3 weights and shape to and from transformers' `DeepseekV3ForCausalLM` (the
architecture of DeepSeek-V3/R1, Kimi K2 and Moonlight).

DeepSeek's RoPE rotates interleaved channel pairs, as loom's does, so no projection is
permuted. Checkpoints hold one tensor per expert (stacked per layer here) and the MTP
modules as extra layers after the last, `model.layers.{n_layers + i}`, each with its own
copy of the embedding and head: export writes them so; transformers ignores them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

from loom.config.declare import COUNT_MAX, SIZE_MAX, bounds
from loom.config.numbers import check_number
from loom.models.deepseek_v3.args import YARN_BOUNDS, DeepseekV3Args
from loom.models.llama.hf import Source, outer_sources, refuse, same, settle_tie
from loom.models.qwen3.hf import EXPERT_NAMES, stacked

ATTENTION_NAMES = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm",
                   "wq_b": "q_b_proj", "wkv_a": "kv_a_proj_with_mqa",
                   "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
MTP_NAMES = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj",
             "norm": "shared_head.norm"}
WIDTHS = ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "moe_intermediate_size")
"""config.json widths that must be positive; q_lora_rank may also be null (no bottleneck)."""
COUNTS = ("n_group", "topk_group", "n_routed_experts", "num_experts_per_tok")
"""config.json counts that must be positive."""
FLOATS = {"rms_norm_eps": bounds(gt=0, le=1), "routed_scaling_factor": bounds(le=1e3)}


def _int(c: dict[str, Any], name: str, low: int, default: int | None = None,
         high: int = SIZE_MAX) -> int:
    """A checked integer of config.json (a ConfigError: the folder is bad, not unsupported)."""
    return check_number(f"config.json: {name}", c.get(name, default),
                        bounds(ge=low, le=high), integer=True)


def _float(params: dict[str, Any], name: str, default: float, where: str = "") -> float:
    """A checked number of config.json (absent or null: `default`), to its declared range."""
    value = params.get(name, default)
    if value is None:
        return default
    return float(check_number(f"config.json: {where}{name}", value,
                              YARN_BOUNDS.get(name) or FLOATS[name]))


def yarn_fields(c: dict[str, Any]) -> dict[str, Any]:
    """RoPE: plain or YaRN (DeepSeek-V3's), from `rope_parameters` or `rope_scaling`."""
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    where = "rope_parameters." if "rope_parameters" in c else "rope_scaling."
    theta = _float(params, "rope_theta", _float(c, "rope_theta", 10000.0), where)
    if kind == "default":
        return {"rope_theta": theta}
    if kind != "yarn":
        raise ValueError(f"RoPE scaling {kind!r} (loom's deepseek-v3 implements yarn)")
    if params.get("truncate", True) is not True or params.get("attention_factor") is not None:
        raise ValueError("YaRN with truncate false or an explicit attention_factor")
    return {"rope_theta": theta, "yarn_factor": _float(params, "factor", 1.0, where),
            "yarn_original_max_seq_len": _int(params, "original_max_position_embeddings", 1),
            **{f"yarn_{name}": _float(params, name, default, where) for name, default in
               (("beta_fast", 32.0), ("beta_slow", 1.0), ("mscale", 1.0),
                ("mscale_all_dim", 0.0))}}


def mla_fields(c: dict[str, Any]) -> dict[str, Any]:
    """The family's own shape fields of a config.json, each checked (its MTP settings are
    training choices: --mtp-layers asks for the folder's MTP modules)."""
    for name in WIDTHS:
        _int(c, name, 1)
    for name in COUNTS:
        _int(c, name, 1, high=COUNT_MAX)
    q_rank = c.get("q_lora_rank")
    return {"q_lora_rank": 0 if q_rank is None else _int(c, "q_lora_rank", 1),
            "kv_lora_rank": c["kv_lora_rank"], "qk_rope_head_dim": c["qk_rope_head_dim"],
            "qk_nope_head_dim": _int(c, "qk_nope_head_dim", 0), "v_head_dim": c["v_head_dim"],
            "n_group": c["n_group"], "topk_group": c["topk_group"],
            **{k: v for k, v in yarn_fields(c).items() if k != "rope_theta"}}


def config_fields(c: dict[str, Any]) -> dict[str, Any]:
    """loom's shared model-config fields of a DeepseekV3 config.json."""
    refuse(c, {"attention_bias": False, "hidden_act": "silu", "rope_interleave": True,
               "scoring_func": "sigmoid", "topk_method": "noaux_tc", "pretraining_tp": 1})
    if c.get("quantization_config") is not None:  # DeepSeek's own FP8 block-scaled release
        raise ValueError("quantization_config (quantized weights: dequantize to bf16 first)")
    heads = _int(c, "num_attention_heads", 1, high=COUNT_MAX)
    return {"dim": _int(c, "hidden_size", 1),
            "n_layers": _int(c, "num_hidden_layers", 1, high=COUNT_MAX),
            "n_heads": heads, "n_kv_heads": heads, "head_dim": 0,
            "hidden_dim": _int(c, "intermediate_size", 1),
            "vocab_size": _int(c, "vocab_size", 1),
            "norm_eps": _float(c, "rms_norm_eps", 1e-6),
            "max_seq_len": _int(c, "max_position_embeddings", 1, 4096),
            "rope_theta": yarn_fields(c)["rope_theta"], "rope_factor": 1.0,
            "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
            "ffn_dim_multiplier": None, "n_experts": c["n_routed_experts"],
            "top_k": c["num_experts_per_tok"], "moe_hidden_dim": c["moe_intermediate_size"],
            "n_shared_experts": _int(c, "n_shared_experts", 0, 1, COUNT_MAX),
            "n_dense_layers": _int(c, "first_k_dense_replace", 0, 0, COUNT_MAX),
            "score_func": "sigmoid",
            "route_norm": bool(c.get("norm_topk_prob", True)),
            "route_scale": _float(c, "routed_scaling_factor", 1.0), "aux_loss_coeff": 0.0,
            **mla_fields(c)}


def block_sources(src: str, dst: str, args: DeepseekV3Args, layer_id: int,
                  ) -> dict[str, Source]:
    """One block's tensors: `src` the Hugging Face layer prefix, `dst` loom's block's."""
    out: dict[str, Source] = {
        f"{dst}attention_norm.weight": ([f"{src}input_layernorm.weight"], same),
        f"{dst}ffn_norm.weight": ([f"{src}post_attention_layernorm.weight"], same)}
    skipped = ("wq",) if args.q_lora_rank else ("wq_a", "q_norm", "wq_b")
    for ours, theirs in ATTENTION_NAMES.items():
        if ours not in skipped:
            out[f"{dst}attention.{ours}.weight"] = ([f"{src}self_attn.{theirs}.weight"], same)
    if layer_id < args.n_dense_layers:
        return {**out, **{f"{dst}feed_forward.{ours}.weight": ([f"{src}mlp.{theirs}.weight"],
                                                                same)
                          for ours, theirs in EXPERT_NAMES.items()}}
    out[f"{dst}moe.router.gate.weight"] = ([f"{src}mlp.gate.weight"], same)
    out[f"{dst}moe.expert_bias"] = ([f"{src}mlp.gate.e_score_correction_bias"], same)
    for ours, theirs in EXPERT_NAMES.items():
        names = [f"{src}mlp.experts.{e}.{theirs}.weight" for e in range(args.n_experts)]
        out[f"{dst}moe.experts.{ours}"] = (names, stacked)
        if args.n_shared_experts:
            out[f"{dst}moe.shared_experts.{ours}.weight"] = (
                [f"{src}mlp.shared_experts.{theirs}.weight"], same)
    return out


def all_sources(args: DeepseekV3Args) -> dict[str, Source]:
    out = outer_sources(args)
    for i in range(args.n_layers):
        out.update(block_sources(f"model.layers.{i}.", f"layers.{i}.", args, i))
    for i in range(args.mtp_layers):
        src, dst, layer = f"model.layers.{args.n_layers + i}.", f"mtp.{i}.", args.n_layers + i
        out.update(block_sources(src, f"{dst}block.", args, layer))
        for ours, theirs in MTP_NAMES.items():
            out[f"{dst}{ours}.weight"] = ([f"{src}{theirs}.weight"], same)
    return out


def held_mtp(layer: int, held: Collection[str]) -> bool:
    """Whether the folder holds any tensor of the MTP module stored as layer `layer`."""
    return any(name.startswith(f"model.layers.{layer}.") for name in held)


class DeepseekV3Adapter:
    """`DeepseekV3ForCausalLM`; imported without its MTP modules (transformers has none)."""

    architectures = ("DeepseekV3ForCausalLM",)

    def fields_from_hf(self, c: dict[str, Any]) -> dict[str, Any]:
        return config_fields(c)

    def absent_modules(self, args: DeepseekV3Args, held: Collection[str]) -> tuple[str, ...]:
        """The MTP modules (loom prefixes) of which the folder holds no tensor at all:
        initialised as a fresh run's (`--mtp-layers` asked for them; transformers'
        `save_pretrained` writes none). One that holds some is read, and a missing tensor
        refused: never half loaded."""
        return tuple(f"mtp.{i}." for i in range(args.mtp_layers)
                     if not held_mtp(args.n_layers + i, held))

    def notes(self, args: DeepseekV3Args, held: Collection[str]) -> list[str]:
        """One stderr line each for the MTP modules initialised fresh and those the folder
        holds that this run leaves out (`--mtp-layers` sets how many train)."""
        out = [f"no weights for MTP module {i} (model.layers.{args.n_layers + i}.*): "
               "initialised fresh" for i in range(args.mtp_layers)
               if not held_mtp(args.n_layers + i, held)]
        unused = 0
        while held_mtp(args.n_layers + args.mtp_layers + unused, held):
            unused += 1
        if unused:
            out.append(f"holds {args.mtp_layers + unused} MTP module(s); this run trains "
                       f"{args.mtp_layers} (--mtp-layers {args.mtp_layers + unused} trains "
                       "them all)")
        return out

    def sources(self, args: DeepseekV3Args) -> dict[str, Source]:
        return all_sources(args)

    def export_refusal(self, args: Any) -> str | None:
        return None if isinstance(args, DeepseekV3Args) else "not a DeepSeek-V3 model"

    def settle(self, args: DeepseekV3Args, read: Callable[[str], torch.Tensor]) -> Any:
        return settle_tie(args, read)

    def hf_config(self, args: DeepseekV3Args, dtype: str) -> dict[str, Any]:
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
        if args.yarn_factor != 1.0:
            rope.update(rope_type="yarn", factor=args.yarn_factor,
                        original_max_position_embeddings=args.yarn_original_max_seq_len,
                        beta_fast=args.yarn_beta_fast, beta_slow=args.yarn_beta_slow,
                        mscale=args.yarn_mscale, mscale_all_dim=args.yarn_mscale_all_dim)
        return {"architectures": list(self.architectures), "model_type": "deepseek_v3",
                "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim,
                "moe_intermediate_size": args.expert_hidden_dim,
                "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
                "num_key_value_heads": args.n_heads, "n_shared_experts": args.n_shared_experts,
                "n_routed_experts": args.n_experts, "routed_scaling_factor": args.route_scale,
                "kv_lora_rank": args.kv_lora_rank, "q_lora_rank": args.q_lora_rank or None,
                "qk_rope_head_dim": args.qk_rope_head_dim, "v_head_dim": args.v_head_dim,
                "qk_nope_head_dim": args.qk_nope_head_dim, "n_group": args.n_group,
                "topk_group": args.topk_group, "num_experts_per_tok": args.top_k,
                "first_k_dense_replace": args.n_dense_layers, "norm_topk_prob": args.route_norm,
                "hidden_act": "silu", "max_position_embeddings": args.max_seq_len,
                "rms_norm_eps": args.norm_eps, "vocab_size": args.vocab_size,
                "tie_word_embeddings": args.tie_embeddings, "rope_parameters": rope,
                "rope_interleave": True, "attention_bias": False,
                "num_nextn_predict_layers": args.mtp_layers,
                "dtype": "float32" if dtype == "fp32" else "bfloat16"}

    def hf_tensors(self, args: DeepseekV3Args, read: Callable[[str], torch.Tensor]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor once (experts unstacked); each MTP layer also gets the copies of the
        embedding and head DeepSeek's checkpoints keep there."""
        for ours, (theirs, _) in all_sources(args).items():
            if ours == "output.weight" and args.tie_embeddings:
                continue
            tensor = read(ours)
            if len(theirs) > 1:
                yield from zip(theirs, tensor.unbind(0), strict=True)
            else:
                yield theirs[0], tensor
        for i in range(args.mtp_layers):
            src = f"model.layers.{args.n_layers + i}."
            yield f"{src}embed_tokens.weight", read("tok_embeddings.weight")
            yield f"{src}shared_head.head.weight", read("output.weight")
