"""What --float8 does to a step's time: the swapped linears' matmuls at the float8 peak,
the casts' memory traffic, and the narrower collectives.

Memory needs nothing here: the trace runs torchao's `Float8Linear` itself (under fake
tensors, as `loom train` converts the model), so what it saves, casts and gathers is in
the traced bytes.

Time, per swapped linear (`loom.numerics.float8.linear_filter`: the blocks' linears, not
the head), from torchao's tensorwise recipe (`torchao/float8/float8_linear.py`):
- FLOPs: 2 per weight per token forward, 4 backward, at the device's dense float8 peak
  (twice bf16's on Hopper) with the same matmul efficiency as bf16's (assumed).
- Casts: the input is cast forward and again for the weight gradient, the output's
  gradient twice (for the input and the weight gradient), the gathered weight once in
  backward (its forward cast runs on the FSDP shard before the float8 all-gather). A cast
  is torchao's `max(abs(x))` then `(x.float() * scale).clamp(...).to(float8)`: eager, each
  op reads and writes its whole tensor, 33 bytes per bf16 element (abs 2 + 2, max 2, fp32
  copy 2 + 4, multiply 4 + 4, clamp 4 + 4, cast 4 + 1); compiled, inductor fuses them into
  one read for the amax and one read-and-write for the cast, 5 bytes. The traffic runs at
  `BANDWIDTH_EFFICIENCY` of the datasheet's HBM bandwidth. Counted per linear, an upper
  bound where torchao's tp styles share one input cast among wq/wk/wv or w1/w3; rowwise
  scales are counted as tensorwise ones (the same bytes, a scale per row).
- Collectives: FSDP2 all-gathers tensorwise weights in float8 (1 byte, not 2); under tp,
  torchao's float8 styles cast each all-gathered activation (forward input, backward
  output gradient) before the gather, so the sequence-parallel all-gathers move 1 byte an
  element while the reduce-scatters stay in --dtype.
A device without float8 matmul units (CPU: emulated; its record in
`loom.observability.devices` has no float8 peak) keeps its bf16 time.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from loom.config import JobConfig, ModelConfig
from loom.models.resolve import plain_model
from loom.numerics.float8 import linear_filter
from loom.plan.device import PlanDevice, figures

BANDWIDTH_EFFICIENCY = 0.7
"""Fraction of the datasheet HBM bandwidth a streaming (cast) kernel reaches (assumed)."""
CAST_BYTES = {"eager": 33, "compiled": 5}
"""Bytes moved per bf16 element cast to float8 (module doc)."""


@dataclass(frozen=True)
class Float8Linears:
    weights: int
    """Elements of the swapped linears' weights."""
    fan_in: int
    """Sum of their input features: the elements of one token's inputs to them."""
    fan_out: int


@cache
def float8_linears(model: ModelConfig) -> Float8Linears:
    """The linears `--float8` swaps, read off the model built on the meta device."""
    cfg = JobConfig(model=model)
    with torch.device("meta"):
        whole = plain_model(cfg)
    keep = linear_filter(whole, cfg)
    swapped = [m for fqn, m in whole.named_modules() if keep(m, fqn)]
    return Float8Linears(sum(m.weight.numel() for m in swapped),
                         sum(m.in_features for m in swapped),
                         sum(m.out_features for m in swapped))


def float8_peak(device: PlanDevice) -> float | None:
    """FLOP/s of the device's float8 matmul units, None without them (CPU: emulated)."""
    peak = figures(device).float8_tflops
    return None if peak is None else peak * 1e12


def float8_flops(cfg: JobConfig) -> float:
    """Forward + backward FLOPs of the swapped linears for one rank's micro-batch of the
    whole model (before tp/cp/pp split it, as `loom.plan.speed._flops`)."""
    if cfg.parallel.float8 == "off":
        return 0.0
    tokens = cfg.train.batch_size * cfg.data.seq_len
    return 6.0 * tokens * float8_linears(cfg.model).weights


def cast_seconds(cfg: JobConfig, tokens: float, tp: int, extra_forward: float,
                 device: PlanDevice) -> float:
    """Seconds of float8 casts for `tokens` of one rank (each linear's tp shard);
    `extra_forward`: the forward passes recomputed under --ac (the input cast again)."""
    bandwidth = figures(device).hbm_tbs
    if cfg.parallel.float8 == "off" or bandwidth is None or float8_peak(device) is None:
        return 0.0
    linears = float8_linears(cfg.model)
    elements = tokens * ((2 + extra_forward) * linears.fan_in + 2 * linears.fan_out) / tp
    elements += linears.weights / tp  # the gathered weight's backward cast
    per_element = CAST_BYTES["compiled" if cfg.parallel.compile else "eager"]
    return elements * per_element / (bandwidth * 1e12 * BANDWIDTH_EFFICIENCY)


def gathered_weight_bytes(cfg: JobConfig, dense_params: float, param_bytes: int,
                          tp: int, share: float = 1.0) -> float:
    """Bytes FSDP all-gathers for `dense_params` (one rank's tp shard of the dense weights,
    of its pipeline stages' `share`): tensorwise float8 weights travel as 1 byte each."""
    if cfg.parallel.float8 != "tensorwise":
        return dense_params * param_bytes
    swapped = min(dense_params, float8_linears(cfg.model).weights / tp * share)
    return dense_params * param_bytes - swapped * (param_bytes - 1)


def tp_collective_units(cfg: JobConfig) -> float:
    """A block's sequence-parallel traffic in activations of --dtype: 2 all-gathers and 2
    reduce-scatters forward, as many backward, and the forward's again when --ac block
    recomputes it; tensorwise float8 all-gathers move half the bytes."""
    gather = 0.5 if cfg.parallel.float8 == "tensorwise" else 1.0
    forwards = 2 if cfg.parallel.activation_checkpoint == "block" else 1
    return (forwards + 1) * 2 * (gather + 1.0)
