"""Pipeline parallel in `loom plan`: every pp rank's peak, composed from traces of its stages.

The model is cut where `loom train` cuts it (`balanced_split` of `layer_costs`), and each
distinct stage (embedding or not, head or not, its block count) is traced for two pipeline
micro-batches (one when the step has one) at the real shapes: its parameters, gradients and
optimizer state, the first micro-batch's forward and backward, and the second's beside what
the first left (unreduced gradients, gathered weights). A rank's phases are then its traced
stage's phases plus

- the other held stages' parameters, gradients and optimizer state, and, after the rank's
  first backward, the gradients each keeps unreduced until the step's end (interleaved);
- the activations of the other micro-batches in flight: the rank's forwards and backwards
  are walked in torch's order (`schedule_actions`), each forward adding the bytes one
  micro-batch of its stage keeps until its backward; the most alive beside one
  computation up to the rank's first backward is added to the first micro-batch's phases,
  the most alive after it to the second's;
- torch's receive buffers (`PipelineStage` allocates one per micro-batch for the input
  activation of every stage but the first and one for the output gradient of every stage
  but the last, and keeps them; their sizes are exact).

Every rank is checked; the worst phase of any rank is the prediction.
"""

from __future__ import annotations

from functools import cache

import torch

from loom.config import JobConfig, ModelConfig
from loom.config.pipeline_layout import (
    balanced_split,
    choose_microbatches,
    effective_schedule,
    stage_indices,
    stages_per_rank,
)
from loom.config.resolved import settled
from loom.models.resolve import plain_model
from loom.numerics.precision import torch_dtype
from loom.parallel.pipeline_stages import layer_costs
from loom.plan.memory import GATHERED, traced
from loom.plan.trace import (
    HELD,
    MICROBATCH,
    PEAK,
    Breakdown,
    Stage,
    first_micro_batch,
    layer_settings,
)

STATIC = ("Sharded Param", "Sharded Grad", "OptState", "Buffer")
"""What a held stage keeps between its micro-batches (tracker categories)."""


@cache
def _costs(model: ModelConfig) -> list[float]:
    with torch.device("meta"):
        return layer_costs(plain_model(JobConfig(model=model)))


def stage_ranges(cfg: JobConfig) -> list[range]:
    """The units (0: embedding, 1..L: blocks, L + 1: norm and head) of each stage."""
    return balanced_split(_costs(cfg.model), cfg.parallel.pp * stages_per_rank(cfg.parallel))


def compute_share(cfg: JobConfig) -> float:
    """The busiest pp rank's share of a step's FLOPs. A dense unit's cost is twice its
    parameters (memory + FLOPs, `layer_costs`), so its FLOPs go as half of it; the
    embedding (a lookup) has none."""
    p = cfg.parallel
    flops = [0.0, *(c / 2 for c in _costs(cfg.model)[1:])]
    ranges = stage_ranges(cfg)
    per_rank = [sum(flops[u] for i in stage_indices(r, p.pp, stages_per_rank(p),
                                                     p.pp_schedule) for u in ranges[i])
                for r in range(p.pp)]
    return max(per_rank) / sum(flops)


Action = tuple[int, bool]
"""(the rank's local stage, forward?) for one micro-batch."""


def schedule_actions(cfg: JobConfig, rank: int) -> list[Action]:
    """A pp rank's stage computations in torch's order. GPipe: every forward, then every
    backward. 1F1B and interleaved 1F1B: warm-up forwards, then a forward and a backward
    at a time, then the remaining backwards; interleaved runs rounds of micro-batches
    through its stages in turn (forwards in stage order, backwards in reverse), with
    (v - 1) rounds + 2 (pp - 1 - rank) warm-up forwards."""
    p = cfg.parallel
    m = choose_microbatches(p, cfg.train.batch_size)
    schedule = effective_schedule(p.pp_schedule, p.pp, m)
    if schedule == "gpipe":
        return [(0, True)] * m + [(0, False)] * m
    v = stages_per_rank(p)
    per_round = m // max(1, m // p.pp) if v > 1 else m
    total = m * v
    warmup = min(total, (v - 1) * per_round + 2 * (p.pp - 1 - rank) if v > 1
                 else p.pp - rank - 1)

    def forward(k: int) -> Action:
        return (k // per_round) % v, True

    def backward(k: int) -> Action:
        return v - 1 - (k // per_round) % v, False

    steady = [a for k in range(warmup, total) for a in (forward(k), backward(k - warmup))]
    return ([forward(k) for k in range(warmup)] + steady
            + [backward(k) for k in range(total - warmup, total)])


def others_alive(cfg: JobConfig, rank: int, kept: list[Breakdown]
                 ) -> tuple[Breakdown, Breakdown]:
    """The most bytes the rank's other micro-batches keep beside one of its computations
    (`kept[s]`: what one micro-batch of local stage s keeps from its forward to its
    backward): up to the rank's first backward, and after it."""
    live: Breakdown = {}
    best: list[Breakdown] = [{}, {}]
    after = 0
    for stage, is_forward in schedule_actions(cfg, rank):
        if is_forward:
            for kind, nbytes in kept[stage].items():
                live[kind] = live.get(kind, 0) + nbytes
        beside = {k: b - kept[stage].get(k, 0) for k, b in live.items()}
        if sum(beside.values()) > sum(best[after].values()):
            best[after] = beside
        if not is_forward:
            for kind, nbytes in kept[stage].items():
                live[kind] -= nbytes
            after = 1
    return best[0], best[1]


def buffer_bytes(cfg: JobConfig, first: bool, last: bool) -> int:
    """A stage's receive buffers: (B/M, T/(cp tp), dim) in the compute dtype per
    micro-batch, for the input (all but the first stage) and the output's gradient (all but
    the last)."""
    p = cfg.parallel
    m = choose_microbatches(p, cfg.train.batch_size)
    act = (cfg.train.batch_size // m * (cfg.data.seq_len // (p.cp * p.tp)) * cfg.model.dim
           * torch_dtype(p.dtype).itemsize)
    return m * act * ((not first) + (not last))


def pipeline_phases(cfg: JobConfig, world_size: int) -> list[Breakdown]:
    """Every phase of every pp rank (module doc); needs `fake_world(world_size)`."""
    p, n = cfg.parallel, cfg.model.n_layers
    ranges = stage_ranges(cfg)
    microbatches = choose_microbatches(p, cfg.train.batch_size)
    microbatch = cfg.train.batch_size // microbatches
    traces: dict[tuple[bool, bool, int], dict[str, Breakdown]] = {}

    def stage(i: int) -> tuple[dict[str, Breakdown], int]:
        units = ranges[i]
        first, last = 0 in units, n + 1 in units
        blocks = sum(1 for u in units if 1 <= u <= n)
        key = (first, last, blocks)
        if key not in traces:
            traces[key] = traced(settled(cfg, **layer_settings(cfg, blocks)), world_size,
                                 Stage(first, last, microbatch, microbatches))
        return traces[key], buffer_bytes(cfg, first, last)

    out = []
    for rank in range(p.pp):
        held = [stage(i) for i in stage_indices(rank, p.pp, stages_per_rank(p), p.pp_schedule)]
        warmup, steady = others_alive(cfg, rank, [phases[MICROBATCH] for phases, _ in held])
        buffers = sum(b for _, b in held)
        for j, (phases, _) in enumerate(held):
            others = [ph for k, (ph, _) in enumerate(held) if k != j]
            for name, phase in phases.items():
                if name in (MICROBATCH, HELD):
                    continue
                # a first micro-batch's phases run before the rank's first backward; the
                # others after it, beside the gradients every stage keeps until the end
                first = first_micro_batch(name) or microbatches == 1
                total = dict(phase)
                for other in others:
                    for kind in STATIC:
                        total[kind] = total.get(kind, 0) + other[PEAK].get(kind, 0)
                    if not first:
                        for kind, nbytes in other[HELD].items():
                            if kind not in GATHERED:
                                total[kind] = total.get(kind, 0) + nbytes
                beside = warmup if first else steady
                blocks = beside.get("Block Activation", 0)
                total["Activation"] = (total.get("Activation", 0) + sum(beside.values())
                                       - blocks)
                total["Block Activation"] = total.get("Block Activation", 0) + blocks
                total["Pipeline Buffers"] = buffers
                out.append(total)
    return out
