"""Predicted step time: counted FLOPs over a device peak, plus communication that cannot
hide behind compute. An estimate for ranking layouts, not a measurement.

FLOPs come from `loom.observability.flops.count_step_flops` (the unsharded model under fake
tensors) at reduced depth, extrapolated per block like memory. Every rank does 1/world of them
(dp splits the batch, tp the matmuls, cp the sequence, pp the layers, see
`predict_step_time` for the pipeline's bubble); activation checkpointing adds the
recomputed forward; --float8's linears run at the float8 peak, their casts cost memory
traffic (`loom.plan.float8`); without --compile the pointwise ops inductor would fuse cost
their own traffic (`loom.plan.fusion`). Communication volume is derived from the layout: FSDP
all-gathers (forward and, when resharding, backward again) and reduce-scatters overlap with
compute; tensor and expert parallel collectives, cp's K/V all-gathers and pp's sends sit on
the critical path.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from loom.config import DataConfig, JobConfig, ModelConfig
from loom.config.pipeline_layout import bubble_fraction, choose_microbatches, stages_per_rank
from loom.config.resolved import settled
from loom.models.registry import routing_of
from loom.models.resolve import plain_model
from loom.numerics.precision import torch_dtype
from loom.observability.devices import CPU
from loom.observability.flops import count_step_flops, measured_peak
from loom.parallel.mesh import ParallelDims
from loom.plan.device import PlanDevice, figures
from loom.plan.float8 import (
    cast_seconds,
    float8_flops,
    float8_peak,
    gathered_weight_bytes,
    tp_collective_units,
)
from loom.plan.fusion import unfused_seconds
from loom.plan.memory import traced_depths
from loom.plan.muon import muon_flops_per_rank
from loom.plan.pipeline_memory import compute_share
from loom.plan.trace import layer_settings

EFFICIENCY = 0.4
"""Fraction of the matmul peak a training step reaches (assumed; torchtitan's published
Llama 3 runs on H100 report 35-45 % MFU). The CPU's measured peak gets the same factor."""

RECOMPUTE = {"none": 0.0, "selective": 0.1, "op": 0.3, "block": 1.0}
"""Extra forward passes recomputed in backward per --ac mode ('selective' recomputes
attention only: ~10 % of a block's forward FLOPs at the presets' shapes, assumed; 'op'
recomputes every other matmul, wk, wo and w3 in loom's block: ~32 % of Llama 3 8B's block
forward at seq 8192, counted from its shapes)."""

BUDGET_RECOMPUTE = 0.2
"""Extra forward fraction per unit of budget below 1 under --compile: the partitioner
recomputes the cheapest (pointwise) ops first (assumed)."""

@dataclass(frozen=True)
class StepTime:
    seconds: float
    compute_s: float
    exposed_comm_s: float
    peak_source: str


def _flops(cfg: JobConfig) -> float:
    """Forward + backward FLOPs of the whole model for one rank's micro-batch."""
    return cfg.train.batch_size * _flops_per_sample(cfg.model, cfg.data.seq_len)


@cache
def _flops_per_sample(model: ModelConfig, seq_len: int) -> float:
    """FLOPs grow linearly with the batch: counted once per model and sequence length, routed
    experts too (their grouped matmuls count top-k rows per token)."""
    cfg = JobConfig(model=model, data=DataConfig(seq_len=seq_len))

    def count(c: JobConfig) -> float:
        return count_step_flops(lambda: plain_model(c), c.train.batch_size, c.data.seq_len).flops
    low_depth, high_depth = traced_depths(cfg)
    if cfg.model.n_layers <= high_depth:
        return count(cfg)
    low, high = (count(settled(cfg, **layer_settings(cfg, d))) for d in (low_depth, high_depth))
    return low + (cfg.model.n_layers - low_depth) * (high - low)


def device_peak(device: PlanDevice, dtype: torch.dtype, cache: Path) -> tuple[float, str]:
    """The matmul peak in `dtype` of the device's own record (the CPU's measured)."""
    record = figures(device)
    if record is CPU:
        return measured_peak(torch.device("cpu"), dtype, cache), "measured on this CPU"
    peak = record.peak(dtype)
    if peak is None:  # every record holds bf16 and fp32; a dtype without a figure is refused
        raise ValueError(f"--device {record.name!r} has no {dtype} peak in loom's table")
    return peak, f"{record.name}: {record.source}"


def bandwidth(device: PlanDevice, group: int) -> float:
    """Bytes/s per device for a collective over `group` consecutive ranks: the device's
    link within its node, its share of the network across nodes."""
    return figures(device).bandwidth(group)


@cache
def param_count(model_cfg: ModelConfig) -> tuple[int, int]:
    """(all parameters, routed-expert parameters) of the model, built on the meta device."""
    with torch.device("meta"):
        model = plain_model(JobConfig(model=model_cfg))
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total, experts


def comm_seconds(cfg: JobConfig, dims: ParallelDims, device: PlanDevice,
                 share: float = 1.0, stretch: float = 1.0) -> tuple[float, float]:
    """(overlappable FSDP seconds, exposed tp/cp/ep/pp seconds) of one step on one rank
    holding `share` of the parameters and layers (pipeline: its stages'). The per-layer
    collectives run inside each stage's micro-batch, so the schedule's bubble `stretch`
    lengthens them as it does the compute; the pipeline's sends count their own slots."""
    p, m = cfg.parallel, cfg.model
    total, experts = param_count(cfg.model)
    param_bytes = 4 if p.dtype == "fp32" else 2
    grad_bytes = 4 if p.dtype == "fp32" or p.reduce_dtype == "fp32" else 2
    dense = (total - experts) / dims.tp * share
    routed = experts / max(1, dims.ep * (dims.tp if dims.etp_enabled else 1)) * share
    accum = cfg.train.grad_accum_steps  # every micro-batch gathers; reductions: see below
    reduced = accum if cfg.train.accum_reduce == "micro-batch" or dims.pp_enabled else 1
    gathers = accum * (2 if p.reshard_after_forward == "always" else 1)
    shard = dims.dp_shard * dims.cp  # FSDP shards over cp too
    shard_ep = dims.efsdp if dims.ep_enabled else shard
    fsdp = ((gathers * gathered_weight_bytes(cfg, dense, param_bytes, dims.tp, share)
             + reduced * dense * grad_bytes) * (shard - 1) / shard
            + routed * (gathers * param_bytes + reduced * grad_bytes) * (shard_ep - 1) / shard_ep)
    fsdp_s = fsdp / bandwidth(device, shard * dims.tp)
    if dims.dp_replicate > 1:  # HSDP: all-reduce of the shard's gradients across replicas
        fsdp_s += reduced * 2 * (dense / shard) * grad_bytes / bandwidth(device, dims.world_size)
    act = cfg.train.batch_size * cfg.data.seq_len // dims.cp * m.dim * param_bytes
    exposed = _layer_collectives(cfg, dims, device, act) * share * stretch
    if dims.pp_enabled:  # each micro-batch's activation forward, its gradient back, on the
        # critical path once per schedule slot (M + pp - 1)
        m_count = choose_microbatches(p, cfg.train.batch_size)
        exposed += ((m_count + dims.pp - 1) * 2 * act / m_count / dims.tp
                    / bandwidth(device, dims.world_size))
    return fsdp_s, exposed * accum  # the exposed terms are one micro-batch's


def _layer_collectives(cfg: JobConfig, dims: ParallelDims, device: PlanDevice,
                       act: int) -> float:
    """Seconds of the tp, ep and cp collectives every layer of the model waits on, for one
    micro-batch of `act` activation bytes (a pipeline rank runs its share of them)."""
    p, m = cfg.parallel, cfg.model
    param_bytes = 4 if p.dtype == "fp32" else 2
    exposed = 0.0
    if dims.tp > 1:  # sequence parallel: all-gathers and reduce-scatters of every block
        exposed += (m.n_layers * tp_collective_units(cfg) * act * (dims.tp - 1) / dims.tp
                    / bandwidth(device, dims.tp))
    if dims.ep > 1:  # dispatch + combine, forward and backward, top_k copies of each token;
        # at etp 1 each tp rank sends its share of the slots over ep consecutive ranks, at
        # etp = tp every tp rank sends all of them over ep ranks tp apart
        routed = routing_of(m)
        moe_layers = m.n_layers - routed.dense_layers if routed else 0
        sent = act * (routed.top_k if routed else 0) / (dims.tp if not dims.etp_enabled else 1)
        span = dims.ep * (dims.tp if dims.etp_enabled else 1)
        exposed += moe_layers * 4 * sent * (dims.ep - 1) / dims.ep / bandwidth(device, span)
    if dims.cp_enabled:  # every block all-gathers K and V (and recomputes them under
        # --ac block); its backward reduce-scatters their gradients
        passes = 3 if p.activation_checkpoint == "block" else 2
        kv = cfg.train.batch_size * cfg.data.seq_len * m.n_kv_heads * (m.dim // m.n_heads)
        exposed += (m.n_layers * passes * 2 * kv / dims.tp * param_bytes * (dims.cp - 1)
                    / dims.cp / bandwidth(device, dims.cp * dims.tp))
    return exposed


def predict_step_time(cfg: JobConfig, world_size: int, device: PlanDevice,
                      cache: Path) -> StepTime:
    """Compute: FLOPs / (tp x cp) per rank. Under --pp the busiest rank's share of them,
    stretched by the schedule's bubble: t = t_rank / (1 - (pp - 1) / (v M + pp - 1)),
    i.e. t_rank (M + pp - 1) / M with one stage per rank (v stages per rank, M micro-batches)."""
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    dtype = torch_dtype(cfg.parallel.dtype)
    peak, source = device_peak(device, dtype, cache)
    p = cfg.parallel
    extra_forward = RECOMPUTE[p.activation_checkpoint]
    if p.compile:
        extra_forward += (1 - p.act_mem_budget) * BUDGET_RECOMPUTE
    recompute = 1 + extra_forward / 3  # the forward is ~1/3 of a step's FLOPs
    share, stretch = 1.0, 1.0
    if dims.pp_enabled:
        share = compute_share(cfg)
        stretch = 1 / (1 - bubble_fraction(dims.pp, stages_per_rank(p),
                                           choose_microbatches(p, cfg.train.batch_size),
                                           p.pp_schedule))
    per_rank = share * recompute * cfg.train.grad_accum_steps / (dims.tp * dims.cp)
    flops = _flops(cfg) * per_rank
    fast = float8_flops(cfg) * per_rank if float8_peak(device) else 0.0  # --float8 linears
    compute = ((flops - fast) / peak + fast / (float8_peak(device) or peak)) / EFFICIENCY
    tokens = cfg.train.batch_size * cfg.data.seq_len / dims.cp * share * cfg.train.grad_accum_steps
    compute += cast_seconds(cfg, tokens, dims.tp, extra_forward, device)
    compute = (compute + unfused_seconds(cfg, tokens, dims.tp, device)) * stretch
    muon = muon_flops_per_rank(cfg, world_size)  # after the pipeline drains: no bubble
    if muon:
        ns_peak, _ = device_peak(device, torch_dtype(cfg.optim.muon_ns_dtype), cache)
        compute += muon / (ns_peak * EFFICIENCY)
    fsdp_s, exposed = comm_seconds(cfg, dims, device, share, stretch)
    exposed += max(0.0, fsdp_s - compute)
    return StepTime(compute + exposed, compute, exposed, source)
