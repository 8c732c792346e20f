"""The pipeline's layout, decided without a process group: which stages a rank holds, how
many micro-batches a batch splits into, where the model is cut, and the flag checks."""

from __future__ import annotations

from loom.config.job import JobConfig
from loom.config.schema import ParallelConfig
from loom.errors import ConfigError

SINGLE = {"gpipe": "GPipe", "1f1b": "1F1B"}
LOOPED = {"interleaved-1f1b": "Interleaved1F1B"}
V_SHAPED = {"zero-bubble": "ZBVZeroBubble", "dualpipev": "DualPipeV"}
SCHEDULES = {**SINGLE, **LOOPED, **V_SHAPED}
"""--pp-schedule -> torch.distributed.pipelining class name (without `Schedule`)."""
MAX_BUBBLE = 0.25
SPLIT_BACKWARD = ("zero-bubble", "dualpipev")
"""Schedules that split backward into input and deferred weight gradients: torch's split
backward gets nested FSDP2 units' weight gradients wrong (tests/parity/test_upstream_zbv.py),
so under them each stage is one FSDP2 unit (`loom.parallel.fsdp.apply_fsdp`), and routed
experts, FSDP2 units of their own, are refused (`loom.config.compose.REFUSALS`)."""


def stages_per_rank(p: ParallelConfig) -> int:
    if p.pp_stages_per_rank:
        return p.pp_stages_per_rank
    return 1 if p.pp_schedule in SINGLE else 2


def stage_indices(pp_rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    """This rank's stages, ascending: looped (r, r + pp, ...) or V-shaped (r, 2 pp - 1 - r)."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(per_rank)]


def bubble_fraction(pp: int, per_rank: int, microbatches: int,
                    schedule: str = "1f1b") -> float:
    """Share of a step each rank idles in. 1F1B and its looped form: (p-1) / (v m + p-1).
    The V-shaped ones split backward into input (B) and weight (W) gradients and fill the
    idle slots with deferred W: per rank the idle time is (p-1)(F + B - 2W) for ZB-V and
    (p-1)(F&B + B - 3W) for DualPipeV (their papers' counts), zero when a chunk's F, B and W
    take equal time (the backward's two matmuls per forward one, split evenly); that needs
    m >= 2p micro-batches to fill the warm-up, and with fewer the V runs like the looped
    1F1B over its two stages per rank."""
    if schedule in V_SHAPED and microbatches >= 2 * pp:
        return 0.0
    return (pp - 1) / (per_rank * microbatches + pp - 1)


def effective_schedule(schedule: str, pp: int, microbatches: int) -> str:
    """torch's 1F1B refuses fewer micro-batches than stages; with so few, every rank runs
    all its forwards before its backwards either way (GPipe's order), so GPipe runs."""
    return "gpipe" if schedule == "1f1b" and microbatches < pp else schedule


def microbatch_problem(schedule: str, pp: int, per_rank: int, microbatches: int) -> str | None:
    """Why torch's schedule refuses this micro-batch count, or None."""
    if schedule == "interleaved-1f1b":
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            return f"interleaved-1f1b needs a multiple of {rounds} micro-batches"
    if schedule == "dualpipev" and microbatches < 2 * pp:
        return f"dualpipev needs at least {2 * pp} micro-batches (one per stage)"
    return None


def choose_microbatches(p: ParallelConfig, batch_size: int) -> int:
    """--pp-microbatches, else the fewest dividing --batch-size with a bubble <= 25% (or the
    most there are, when the batch is too small for that)."""
    if p.pp_microbatches:
        return p.pp_microbatches
    per_rank = stages_per_rank(p)
    counts = [m for m in range(1, batch_size + 1) if batch_size % m == 0
              and microbatch_problem(p.pp_schedule, p.pp, per_rank, m) is None]
    if not counts:
        raise ConfigError(f"--pp-schedule {p.pp_schedule}: no micro-batch count divides "
                          f"--batch-size {batch_size}; raise --batch-size")
    fitting = [m for m in counts
               if bubble_fraction(p.pp, per_rank, m, p.pp_schedule) <= MAX_BUBBLE]
    return fitting[0] if fitting else counts[-1]


def balanced_split(costs: list[float], n_stages: int) -> list[range]:
    """Contiguous ranges of units, one per stage, minimising the costliest stage (every
    stage gets at least one unit)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the least max-stage cost of putting units[:i] into s stages
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                worst = max(best[s - 1][j], prefix[i] - prefix[j])
                if worst < best[s][i]:
                    best[s][i], cut[s][i] = worst, j
    bounds, end = [], n
    for s in range(n_stages, 0, -1):
        bounds.append(range(cut[s][end], end))
        end = cut[s][end]
    return bounds[::-1]


def validate_pipeline(cfg: JobConfig) -> None:
    """--pp and its flags, one line each (its combinations with other features are refused
    from `loom.config.compose`'s table, before this runs)."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    for name in ("pp", "pp_microbatches", "pp_stages_per_rank"):
        if getattr(p, name) < (1 if name == "pp" else 0):
            raise ConfigError(f"--{name.replace('_', '-')} must be >= "
                              f"{1 if name == 'pp' else 0}, got {getattr(p, name)}")
    if p.pp == 1:
        return
    per_rank = stages_per_rank(p)
    if p.pp_schedule in SINGLE and per_rank != 1:
        raise ConfigError(f"--pp-schedule {p.pp_schedule} runs one stage per rank; use "
                          "interleaved-1f1b for --pp-stages-per-rank > 1")
    if p.pp_schedule in LOOPED and per_rank < 2:
        raise ConfigError(f"--pp-schedule {p.pp_schedule} needs --pp-stages-per-rank >= 2")
    if p.pp_schedule in V_SHAPED and per_rank != 2:
        raise ConfigError(f"--pp-schedule {p.pp_schedule} runs two stages per rank (a V); "
                          "drop --pp-stages-per-rank")
    units = m.n_layers + 2  # the embedding and the head count as layers
    if p.pp * per_rank > units:
        raise ConfigError(f"--pp {p.pp} x {per_rank} stages per rank exceeds the "
                          f"{units} layers (embedding, {m.n_layers} blocks, head) to split")
    if m.runs_transformers:
        raise ConfigError("--pp needs loom's own model (a Hugging Face model is one module)")
    if p.pp_microbatches and t.batch_size % p.pp_microbatches:
        raise ConfigError(f"--pp-microbatches {p.pp_microbatches} must divide --batch-size "
                          f"{t.batch_size} (each pipeline micro-batch is a slice of it)")
    problem = microbatch_problem(p.pp_schedule, p.pp, per_rank,
                                 choose_microbatches(p, t.batch_size))
    if problem:
        raise ConfigError(f"--pp-microbatches: {problem}")
