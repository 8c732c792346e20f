"""What --compile saves in a step's time: the memory traffic of the pointwise ops inductor
fuses, which eager runs one kernel each.

Between the matmuls a Llama block runs chains of pointwise ops (loom.models.llama.model):
two RMSNorms, RoPE on the queries and keys, SwiGLU's silu-and-multiply. Eager, every op
reads its inputs from HBM and writes its output back; compiled, inductor fuses a chain into
one kernel that reads the chain's inputs once and writes its output once. The difference,
in bytes per element of the chain's input with bf16 activations (each op's reads + writes):
- RMSNorm: the fp32 norm reads x (2), `x * rstd` reads x and writes fp32 (2 + 4), the cast
  back (4 + 2), the weight's multiply (2 + 2): 18 eager, 4 fused (read x, write the
  output): 14 saved, per element of dim, two norms a block.
- RoPE: the fp32 copy (2 + 4), four products and two sums of the halves (each half-element
  fp32: 2 + 2 per product, 4 + 2 per sum: 28), stacking them (4 + 4), the cast back
  (4 + 2): 48 eager, 4 fused: 44 saved, per element of the queries and keys.
- SwiGLU: silu (2 + 2), its product with w3's output (4 + 2): 10 eager, 6 fused: 4 saved,
  per element of the hidden dim.
The residual adds cost the same either way (their reads and write remain in the fused
kernel). Backward: each op reads its output's gradient and its saved inputs and writes
the inputs' gradients, twice the forward's traffic for the products that dominate; the
forward's chains run again where --ac recomputes them (`block` and `op`: every pointwise
op; `selective`: the attention's RoPE). The traffic runs at `BANDWIDTH_EFFICIENCY` of the
datasheet's HBM bandwidth, as float8's casts (`loom.plan.float8`).

Counted for the dense Llama-family block in bf16; routed-expert blocks, Qwen3's per-head
norms, the loss's pointwise ops and --dtype fp32 runs are not counted (0 seconds).
"""

from __future__ import annotations

from loom.config import JobConfig
from loom.models.registry import for_config
from loom.models.resolve import model_args
from loom.plan.device import PlanDevice, figures
from loom.plan.float8 import BANDWIDTH_EFFICIENCY

SAVED_BYTES = {"norm": 14, "rope": 44, "swiglu": 4}
"""Bytes fusion saves per element of each chain's input (module doc), bf16 activations."""
BACKWARD = 2.0
"""A backward's pointwise traffic over its forward's (module doc)."""
RECOMPUTED = {"none": (), "selective": ("rope",), "op": ("norm", "rope", "swiglu"),
              "block": ("norm", "rope", "swiglu")}
"""The chains each --ac mode runs again in backward."""


def saved_bytes_per_token(cfg: JobConfig) -> dict[str, float]:
    """One block's forward bytes fusion saves for one token, per chain (whole, before tp)."""
    m = cfg.model
    args = model_args(cfg)
    head_dim = m.dim // m.n_heads
    return {"norm": 2 * m.dim * SAVED_BYTES["norm"],
            "rope": (m.n_heads + m.n_kv_heads) * head_dim * SAVED_BYTES["rope"],
            # a family without a SwiGLU hidden dim (a custom one) counts no SwiGLU
            "swiglu": getattr(args, "ffn_hidden_dim", 0) * SAVED_BYTES["swiglu"]}


def unfused_seconds(cfg: JobConfig, tokens: float, tp: int, device: PlanDevice) -> float:
    """Seconds an eager step spends on the pointwise traffic a compiled one fuses away, for
    `tokens` of one rank through the whole model (after cp; a pipeline rank's: times its
    share, as `loom.plan.float8.cast_seconds`), each tp rank moving 1/tp of it (sequence
    parallel splits the norms' tokens, tp the heads and the hidden dim)."""
    p = cfg.parallel
    bandwidth = figures(device).hbm_tbs
    if (p.compile or bandwidth is None or p.dtype != "bf16"
            or for_config(cfg.model).active_params is not None):
        return 0.0
    chains = saved_bytes_per_token(cfg)
    per_token = (1 + BACKWARD) * sum(chains.values()) + sum(
        chains[c] for c in RECOMPUTED[p.activation_checkpoint])
    return tokens * cfg.model.n_layers * per_token / tp / (bandwidth * 1e12 * BANDWIDTH_EFFICIENCY)
