"""The optimizer's flags: AdamW (the default) or Muon for the blocks' weight matrices with
AdamW for the rest. Declared apart from `loom.config.schema` (which re-exports it) so each
module stays one screenful of one subject.

Muon's defaults are the published ones torch.optim.Muon ships (torch 2.11-2.15): momentum
0.95 with Nesterov, 5 Newton-Schulz steps of the quintic (3.4445, -4.7750, 2.0315), weight
decay 0.1; its learning rate is adjusted per matrix to match AdamW's update RMS (Moonshot's
`0.2 * sqrt(max(rows, cols))`), so `--lr` tuned for AdamW carries over."""

from __future__ import annotations

from dataclasses import dataclass

from loom.config.declare import bounds, flag

NS_COEFFICIENTS = "3.4445,-4.775,2.0315"
"""Keller Jordan's quintic, as torch.optim.Muon's defaults (DEFAULT_A, _B, _C)."""
NS_COEFFICIENT = bounds(ge=-1e3, le=1e3)
"""Each coefficient's range: published quintics stay within +-30 (Polar Express's first
step: 8.3, -23.6, 17.3); 1e308 passed a finiteness check and overflowed torch's addmm."""


def ns_coefficients(text: str) -> tuple[float, float, float]:
    """--muon-ns-coefficients as three floats (validate checks it parses before any use)."""
    a, b, c = (float(x) for x in text.split(","))
    return a, b, c


@dataclass(frozen=True)
class OptimConfig:
    optimizer: str = flag(
        "adamw", "adamw: AdamW for every parameter; muon: Muon for the blocks' weight matrices "
        "(attention and MLP projections, each expert's matrix, LoRA's A and B), each "
        "orthogonalized whole at every layout, and AdamW for the rest (embeddings, output "
        "head, norms, biases, routers)", choices=("adamw", "muon"))
    lr: float = flag(3e-3, "AdamW learning rate (--optimizer muon: also Muon's, unless "
                     "--muon-lr)")
    max_grad_norm: float = flag(1.0, "clip the global gradient norm; <= 0 disables", ge=None,
                                finite=False)
    lr_schedule: str = flag("constant", "learning-rate schedule after warmup",
                            choices=("constant", "cosine", "linear", "wsd"))
    warmup_steps: int = flag(0, "linear warmup from 0 to --lr over this many steps")
    min_lr_ratio: float = flag(0.0, "floor of the decaying schedules, as a fraction of --lr", le=1)
    decay_fraction: float = flag(0.2, "wsd: fraction of the steps spent decaying at the end",
                                 gt=0, le=1)
    muon_lr: float | None = flag(None, "--optimizer muon: the matrices' learning rate before "
                                 "--muon-adjust-lr (default: --lr); the schedule scales it too",
                                 type=float)
    muon_momentum: float = flag(0.95, "--optimizer muon: momentum of the matrices' gradient "
                                "average", lt=1)
    muon_nesterov: bool = flag(True, "--optimizer muon: Nesterov momentum (orthogonalize the "
                               "gradient's lookahead, not the average itself)")
    muon_ns_steps: int = flag(5, "--optimizer muon: Newton-Schulz iterations orthogonalizing "
                              "each matrix's momentum", ge=1, le=99)
    muon_ns_coefficients: str = flag(
        NS_COEFFICIENTS, "--optimizer muon: the Newton-Schulz quintic's coefficients a,b,c "
        "(torch.optim.Muon's)")
    muon_ns_dtype: str = flag(
        "bf16", "--optimizer muon: the Newton-Schulz iteration's precision: bf16 "
        "(torch.optim.Muon's own) or fp32 (the same iteration in float32: layouts then agree "
        "to fp32 summation order, which bf16 rounding turns into ~2e-3 of a weight's norm "
        "after 5 steps; slower)", choices=("bf16", "fp32"))
    muon_adjust_lr: str = flag(
        "match-rms-adamw", "--optimizer muon: per-matrix learning-rate scale: "
        "0.2 * sqrt(max(rows, cols)), matching AdamW's update RMS (Moonshot), or "
        "sqrt(max(1, rows / cols)) (Keller Jordan's original)",
        choices=("match-rms-adamw", "original"))
    muon_weight_decay: float = flag(0.1, "--optimizer muon: the matrices' decoupled weight "
                                    "decay (times their learning rate)")
