"""Qwen3 (dense) and Qwen3-MoE weights and shape to and from transformers.

Qwen3 is Llama with per-head RMSNorm of queries and keys (`--qk-norm`) and an explicit head
width; Qwen3-MoE is loom's mixture of experts configured as Qwen3 routes: softmax scores
over every expert, top-k, optionally renormalised, no shared experts, no expert bias. Its
checkpoints hold one tensor per expert; loom stacks them per layer.
"""

from __future__ import annotations

from typing import Any

import torch

from loom.models.llama.hf import (
    LlamaAdapter,
    Source,
    block_sources,
    dense_config,
    dense_fields,
    outer_sources,
    refuse,
    same,
)
from loom.models.moe.model import MoEArgs

EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


class Qwen3Adapter(LlamaAdapter):
    """`Qwen3ForCausalLM`: Llama's tensors plus the q/k norms (its sources cover them)."""

    architectures = ("Qwen3ForCausalLM",)

    def fields_from_hf(self, c: dict[str, Any]) -> dict[str, Any]:
        return {**dense_fields(c), "qk_norm": True}

    def export_refusal(self, args: Any) -> str | None:
        if getattr(args, "n_experts", 0):
            return "a mixture of experts"
        return None if args.qk_norm else "no q/k norm (Qwen3 has it; Llama does not)"

    def hf_config(self, args: Any, dtype: str) -> dict[str, Any]:
        return {"architectures": list(self.architectures), "model_type": "qwen3",
                "use_sliding_window": False, **dense_config(args, dtype)}


def stacked(*experts: torch.Tensor) -> torch.Tensor:
    return torch.stack(experts)


class Qwen3MoeAdapter(LlamaAdapter):
    """`Qwen3MoeForCausalLM` (every layer sparse, as Qwen3-30B-A3B and 235B-A22B are)."""

    architectures = ("Qwen3MoeForCausalLM",)

    def fields_from_hf(self, c: dict[str, Any]) -> dict[str, Any]:
        refuse(c, {"decoder_sparse_step": 1, "mlp_only_layers": []})
        fields = {**dense_fields(c), "qk_norm": True}
        fields.update(n_experts=int(c.get("num_experts") or c["num_local_experts"]),
                      top_k=int(c["num_experts_per_tok"]), n_shared_experts=0,
                      moe_hidden_dim=int(c["moe_intermediate_size"]), n_dense_layers=0,
                      score_func="softmax", route_norm=bool(c.get("norm_topk_prob", False)),
                      route_scale=1.0, load_balance_coeff=0.0, aux_loss_coeff=0.0)
        return fields

    def sources(self, args: MoEArgs) -> dict[str, Source]:
        out = outer_sources(args)
        for i in range(args.n_layers):
            out.update(block_sources(i, args))
            src, dst = f"model.layers.{i}.mlp.", f"layers.{i}.moe."
            out[f"{dst}router.gate.weight"] = ([f"{src}gate.weight"], same)
            for ours, theirs in EXPERT_NAMES.items():
                names = [f"{src}experts.{e}.{theirs}.weight" for e in range(args.n_experts)]
                out[f"{dst}experts.{ours}"] = (names, stacked)
        return out

    def export_refusal(self, args: Any) -> str | None:
        if not getattr(args, "n_experts", 0):
            return "a dense model"
        checks = [(args.n_shared_experts > 0, f"shared experts (--n-shared-experts "
                                              f"{args.n_shared_experts})"),
                  (args.score_func != "softmax", f"{args.score_func} router scores "
                                                 "(Qwen3-MoE uses softmax)"),
                  (args.load_balance_coeff > 0, "expert-bias balancing (--load-balance-coeff "
                                                f"{args.load_balance_coeff})"),
                  (args.n_dense_layers > 0, f"dense leading layers (--n-dense-layers "
                                            f"{args.n_dense_layers})"),
                  (args.route_scale != 1.0, f"--route-scale {args.route_scale}"),
                  (not args.qk_norm, "no q/k norm (Qwen3-MoE has it)")]
        return next((why for failed, why in checks if failed), None)

    def hf_config(self, args: MoEArgs, dtype: str) -> dict[str, Any]:
        return {"architectures": list(self.architectures), "model_type": "qwen3_moe",
                "num_experts": args.n_experts, "num_experts_per_tok": args.top_k,
                "moe_intermediate_size": args.expert_hidden_dim,
                "norm_topk_prob": args.route_norm, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "use_sliding_window": False,
                "output_router_logits": False, **dense_config(args, dtype)}
