"""Per-rank peak memory of a training step: traced at reduced depth, extrapolated per
block, plus the small analytic term a tensor trace cannot see.

Depth: a step is traced with `d` and `d + 1` blocks (d = the leading dense blocks + 1, so
both traces contain every kind of block). The peak of a shallow trace can sit in a different
phase than the full model's (e.g. the output head's backward rather than the start of the
blocks' backward), so each phase is extrapolated on its own: the step's peak and every FSDP
unit's forward and backward peak snapshot, matched by name across the two traces (the last
block as 'last'). Per-block categories (sharded parameters, gradients, optimizer state,
saved activations) grow by the same amount per added block, so at full depth they are
`at(d) + (L - d) * (at(d + 1) - at(d))`; transient categories (gathered parameters and
gradients, collective buffers, backward temporaries) hold at most the blocks in flight: the
larger of the two traces, plus, after a first micro-batch, what each block leaves held for
the next (gradients kept unreduced and parameters kept gathered by a pipeline stage or under
--grad-accum-steps; the `HELD` difference of the traces). Activations grow per block by at
most what one block saves for its backward (`extrapolate`). The blocks' share of each
phase's activations (blocks x the per-block growth) is kept apart as block activations,
which --compile shrinks (`loom.plan.compiled`). The predicted peak is the largest phase.
A stage without blocks is traced whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.config import JobConfig
from loom.config.resolved import settled
from loom.models.registry import routing_of
from loom.plan.compiled import compiled_block_fraction
from loom.plan.trace import (
    HELD,
    MICROBATCH,
    Breakdown,
    Stage,
    first_micro_batch,
    layer_settings,
    part_names,
    trace_step,
)

GiB = 2**30

CATEGORIES = {
    # FSDPMemTracker category -> the breakdown's name
    "Sharded Param": "parameters", "Unsharded Param": "parameters", "Buffer": "parameters",
    "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
    "OptState": "optimizer", "Activation": "activations", "Temp": "backward_temps",
    "Block Activation": "block_activations",  # split off by `extrapolate`
    "All Gather": "fsdp_buffers", "Reduce Scatter": "fsdp_buffers", "Inputs": "inputs",
    "Pipeline Buffers": "pipeline_buffers",  # loom.plan.pipeline_memory's, not the tracker's
}

ANALYTIC: dict[str, dict[str, float]] = {
    # The term a tensor trace cannot see, per device kind (bytes are GiB; fractions of the
    # traced peak). CPU runs use malloc directly: nothing is added, the trace is compared
    # with measurement as is (benchmarks/plan_accuracy.py).
    "cpu": {"fragmentation": 0.0, "context_gib": 0.0, "compile_workspace_gib": 0.0},
    # Accelerators: the caching allocator rounds blocks to 512 B and keeps freed blocks in
    # 2 MiB / 20 MiB segments, so reserved exceeds allocated (PyTorch CUDA semantics notes,
    # "Memory management"; assumed 5 %, not measured here); the CUDA context with cuBLAS
    # and NCCL workspaces takes ~0.5-1 GiB per device outside the allocator (assumed 0.75);
    # inductor's autotuning and Triton workspaces under --compile (assumed 0.5 GiB).
    "accelerator": {"fragmentation": 0.05, "context_gib": 0.75, "compile_workspace_gib": 0.5},
}


@dataclass(frozen=True)
class MemoryPrediction:
    breakdown_gib: dict[str, float]
    """GiB per category at the worst rank's peak, the analytic term as `overhead`."""

    @property
    def peak_gib(self) -> float:
        return sum(self.breakdown_gib.values())


def traced_depths(cfg: JobConfig) -> tuple[int, int]:
    routed = routing_of(cfg.model)
    first = routed.dense_layers + 1 if routed else 1
    return first, first + 1


TRANSIENT = {"Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter", "Temp"}
GATHERED = {"Unsharded Param"}


def extrapolate(low: Breakdown, high: Breakdown, low_depth: int, depth: int,
                block_saves: int, held: Breakdown | None = None) -> Breakdown:
    """One phase at `depth` blocks. A block adds between nothing and what it saves for its
    backward (`block_saves`) to the activations alive at any point of the step; a larger
    difference between the traces means their phases sit at different points (a peak that
    moved, a unit's buffers still held), not growth, and is clamped. `held`: per block, what
    an earlier micro-batch left alive in this phase (transient kinds)."""
    out = {}
    held = held or {}
    for kind in (set(low) | set(high)) - {"Activation"}:
        a, b = low.get(kind, 0), high.get(kind, 0)
        if kind in TRANSIENT:
            out[kind] = max(a, b) + (depth - low_depth - 1) * held.get(kind, 0)
        else:
            out[kind] = max(0, a + (depth - low_depth) * (b - a))
    growth = min(max(0, high.get("Activation", 0) - low.get("Activation", 0)), block_saves)
    activations = low.get("Activation", 0) + (depth - low_depth) * growth
    out["Block Activation"] = min(activations, depth * growth)
    out["Activation"] = activations - out["Block Activation"]
    return out


def held_in_phase(name: str, held: Breakdown, embedding: str | None) -> Breakdown | None:
    """What a block's earlier micro-batch leaves alive in phase `name`: its unreduced
    gradients throughout the next one; its gathered parameters (a pipeline stage keeps them
    from a block's backward to its next forward) only in the embedding's phases, whose
    forward comes before, and backward after, every block's."""
    if first_micro_batch(name) or name == MICROBATCH:
        return None
    if embedding is not None and name.split("|")[0].endswith(embedding):
        return held
    return {kind: nbytes for kind, nbytes in held.items() if kind not in GATHERED}


def traced(cfg: JobConfig, world_size: int, stage: Stage | None = None) -> dict[str, Breakdown]:
    """Rank 0's bytes by tracker category in each phase at full depth (module doc), and
    `MICROBATCH` and `HELD`; `stage`: of that pipeline stage with `cfg`'s blocks."""
    low_depth, high_depth = traced_depths(cfg)
    if cfg.model.n_layers == 0:
        return trace_step(cfg, world_size, stage)
    low = trace_step(settled(cfg, **layer_settings(cfg, low_depth)), world_size, stage)
    high = trace_step(settled(cfg, **layer_settings(cfg, high_depth)), world_size, stage)
    block_saves = max(0, high[MICROBATCH].get("Activation", 0)
                      - low[MICROBATCH].get("Activation", 0))
    low_held, high_held = low.pop(HELD), high.pop(HELD)
    held = {kind: max(0, high_held.get(kind, 0) - low_held.get(kind, 0)) for kind in TRANSIENT}
    depth = cfg.model.n_layers
    phases = {name: extrapolate(low[name], high[name], low_depth, depth, block_saves,
                                held_in_phase(name, held, part_names(cfg).embedding))
              for name in low.keys() & high.keys()}
    phases[HELD] = {kind: max(0, low_held.get(kind, 0) + (depth - low_depth) * growth)
                    for kind, growth in held.items()}
    return phases


def in_gib(breakdown: Breakdown) -> dict[str, float]:
    """Tracker categories folded into the report's categories, in GiB."""
    gib = dict.fromkeys(CATEGORIES.values(), 0.0)
    for kind, nbytes in breakdown.items():
        name = CATEGORIES.get(kind, kind.lower())
        gib[name] = gib.get(name, 0.0) + nbytes / GiB
    return gib


def finish(gib: dict[str, float], cfg: JobConfig, device_kind: str) -> MemoryPrediction:
    """An eager phase of `cfg` with the blocks' activations as --compile saves them and the
    analytic term added; block activations fold into `activations`."""
    gib = dict(gib)
    blocks = gib.pop("block_activations", 0.0)
    gib["activations"] = gib.get("activations", 0.0) + blocks * compiled_block_fraction(cfg)
    terms = ANALYTIC["cpu" if device_kind == "cpu" else "accelerator"]
    overhead = terms["fragmentation"] * sum(gib.values()) + terms["context_gib"]
    if cfg.parallel.compile:
        overhead += terms["compile_workspace_gib"]
    return MemoryPrediction({**gib, "overhead": overhead})
