"""The mixture-of-experts family's flags (`--n-experts`, `--top-k`, ...): declared here, with
their defaults and validation, and gathered by `loom.config` from the registered families."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loom.config.declare import COUNT_MAX, DEGREE, SIZE_MAX, flag
from loom.config.validate import check_expert_layout
from loom.errors import ConfigError


@dataclass(frozen=True)
class MoEFlags:
    """Mixture of experts

    The moe and qwen3-moe families; --n-experts > 0 picks moe when --family is unset."""

    n_experts: int = flag(0, "routed experts per MoE layer (0 = dense model)", le=COUNT_MAX)
    top_k: int = flag(2, "MoE: experts each token is routed to", **DEGREE)
    n_shared_experts: int = flag(1, "MoE: always-on shared experts per layer", le=COUNT_MAX)
    moe_hidden_dim: int | None = flag(None, "MoE: hidden dim of each expert "
                                      "(default: the SwiGLU hidden dim)", type=int, le=SIZE_MAX)
    n_dense_layers: int = flag(1, "MoE: leading blocks that keep a dense feed-forward",
                               le=COUNT_MAX)
    score_func: str = flag("sigmoid", "MoE: router score function (computed in fp32)",
                           choices=("sigmoid", "softmax"))
    route_norm: bool = flag(True, "MoE: normalise the chosen experts' scores to sum to 1")
    route_scale: float = flag(1.0, "MoE: multiply the routed experts' weights by this", gt=0)
    load_balance_coeff: float = flag(1e-3, "MoE: expert-bias step per optimizer step "
                                     "(aux-loss-free balancing; 0 disables)")
    aux_loss_coeff: float = flag(0.0, "MoE: weight of the sequence-wise balance loss (0 = off)")

    def implied_family(self) -> str | None:
        """The family these flags pick when --family is unset (`registry.family_name`)."""
        return "moe" if self.n_experts else None

    def check(self, cfg: Any) -> None:
        """Expert counts and the expert-parallel degrees they allow (a dense model takes
        neither --ep nor --etp)."""
        m, p = cfg.model, cfg.parallel
        if self.n_experts == 0:
            if p.ep != 1 or p.etp != 1:
                raise ConfigError(f"--ep {p.ep} / --etp {p.etp} need a mixture-of-experts "
                                  "model (--n-experts > 0, e.g. --model moe-debug)")
            return
        if not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(f"--top-k {self.top_k} must be in [1, --n-experts "
                              f"{self.n_experts}]")
        if p.ep < 1 or self.n_experts % p.ep:
            raise ConfigError(f"--n-experts {self.n_experts} is not divisible by --ep {p.ep}")
        check_expert_layout(p.ep, p.etp, p.tp, p.dp_shard * p.cp if p.dp_shard > 0 else None)
        if (self.moe_hidden_dim or 0) % p.tp or self.n_dense_layers > m.n_layers:
            raise ConfigError(f"--moe-hidden-dim {self.moe_hidden_dim} must be divisible by "
                              f"--tp {p.tp}; --n-dense-layers {self.n_dense_layers} must be "
                              f"in [0, --n-layers {m.n_layers}]")


def moe_flags(m: Any) -> MoEFlags:
    """A ModelConfig's MoE flags (the families built on MoE read them)."""
    return m.flags_of(MoEFlags)
