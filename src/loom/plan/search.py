"""`loom plan --search`: the ten fastest predicted configurations that fit.

Enumerated: layouts (tp up to a node, dp_replicate 1 or 2, cp 1-8 where the sequence splits,
pp 1-8 where the blocks split evenly, >= 2 a stage, with 1F1B at pp or 2 pp micro-batches,
dp_shard the rest; MoE models: ep 1-64 dividing dp_shard x cp x tp and the experts, at
--etp 1) and knobs (--ac, --reshard-after-forward, micro-batch 1-8, off or --compile at
budget 0.5; --loss-impl fused-linear, see `LOSSES`; chunked-backward for pp with tp, whose
fused head trains (tests/parity/test_pipeline_parity.py) but is not yet traced by the plan; under
--grad-accum-steps without pp, --accum-reduce step or micro-batch).
Candidates are visited fastest first (the step-time estimate needs no trace); one that a
traced, lighter configuration already rules out is skipped untraced (`ruled_out`). Memory
depends on (tp, dp_shard, ac, loss, reshard, pp, micro-batches, cp, ep, accum-reduce) only,
so each such key is traced once at one sample per (pipeline) micro-batch; in every phase of
that trace the batch-proportional categories (activations, backward temporaries, inputs,
pipeline buffers) are scaled by the samples per micro-batch, and the largest phase counts;
the compile budget and the analytic term are applied as in `loom plan`. Run `loom plan` on a
printed line for its exact trace. Tracing stops after `TIME_BUDGET_S` seconds of this
process's CPU time (wall time on an idle machine; the same answer on a loaded one), and says
so.
"""

from __future__ import annotations

import itertools
import json
import shlex
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from loom.config import ConfigError, JobConfig, validate
from loom.config.resolved import settled
from loom.models.registry import routing_of
from loom.parallel.mesh import ParallelDims
from loom.plan.device import PlanDevice
from loom.plan.memory import GiB, finish, in_gib
from loom.plan.peaks import traced_phases
from loom.plan.speed import predict_step_time
from loom.plan.trace import fake_world

TIME_BUDGET_S = 90.0
TOP = 10
PER_SAMPLE = ("activations", "block_activations", "backward_temps", "inputs",
              "pipeline_buffers")
MICRO_BATCHES = (8, 4, 2, 1)
AC_MODES = ("none", "selective", "op", "block")
COMPILE = ((False, 1.0), (True, 0.5))
LOSSES = ("fused-linear",)
"""The step-time estimate cannot tell the loss modes apart, so searching them only printed
the same layout once per mode (and cost a trace each); fused-linear holds the least."""


def pipeline_degrees(cfg: JobConfig, rest: int) -> list[int]:
    """pp degrees worth searching: dividing the ranks left and the blocks, >= 2 blocks a
    stage (MoE: none, see `check_supported`)."""
    n = cfg.model.n_layers
    if routing_of(cfg.model):
        return [1]
    return [pp for pp in (1, 2, 4, 8) if rest % pp == 0 and n % pp == 0 and n >= 2 * pp]


def expert_degrees(cfg: JobConfig, region: int) -> list[int]:
    """ep degrees worth searching: dividing the ranks it spans at --etp 1 (dp_shard x cp x
    tp) and the experts."""
    routed = routing_of(cfg.model)
    n = routed.experts if routed else 0
    return [ep for ep in (1, 2, 4, 8, 16, 32, 64) if region % ep == 0 and n % ep == 0] \
        if n else [1]


def layouts(cfg: JobConfig, world: int) -> list[tuple[int, int, int, int, int]]:
    """(tp, dp_replicate, pp, cp, dp_shard) with tp up to 8 (an 8-GPU node's NVLink)."""
    out = []
    tps = [t for t in (1, 2, 4, 8) if t <= world and world % t == 0]
    for tp, replicate, cp in itertools.product(tps, (1, 2), (1, 2, 4, 8)):
        if world % (tp * replicate * cp):
            continue
        for pp in pipeline_degrees(cfg, world // (tp * replicate * cp)):
            out.append((tp, replicate, pp, cp, world // (tp * replicate * cp * pp)))
    return out


def microbatch_counts(pp: int, batch: int) -> list[int]:
    """--pp-microbatches searched: pp and 2 pp (1F1B's bubble (pp - 1) / (M + pp - 1)),
    where they divide the batch; 0 (unset) without a pipeline."""
    return [m for m in (pp, 2 * pp) if batch % m == 0] if pp > 1 else [0]


def reductions(cfg: JobConfig, pp: int) -> tuple[str, ...]:
    """--accum-reduce values worth searching: both under --grad-accum-steps (once a step
    holds every weight's full gradient; every micro-batch reduces that many times more),
    else the default; a pipeline reduces after each of its schedule's runs either way."""
    return ("step", "micro-batch") if cfg.train.grad_accum_steps > 1 and pp == 1 else ("step",)


def candidates(cfg: JobConfig, world: int) -> list[dict[str, Any]]:
    """The settings of every valid configuration of the search space, by flag name (each
    `settled` on `cfg` validates like `loom train` flags)."""
    out = []
    for (tp, replicate, pp, cp, shard), ac, reshard, mb, (compiled, budget) in \
            itertools.product(layouts(cfg, world), AC_MODES, ("never", "always"),
                              MICRO_BATCHES, COMPILE):
        # pp with tp: the fused head trains, but the plan's trace of it is unchecked
        loss = "chunked-backward" if pp > 1 and tp > 1 else LOSSES[0]
        for m, ep, accum in itertools.product(microbatch_counts(pp, mb),
                                              expert_degrees(cfg, shard * cp * tp),
                                              reductions(cfg, pp)):
            settings = dict(tp=tp, dp_replicate=replicate, dp_shard=shard, pp=pp, cp=cp,
                            pp_microbatches=m, pp_schedule="1f1b", pp_stages_per_rank=0,
                            activation_checkpoint=ac, reshard_after_forward=reshard,
                            compile=compiled, act_mem_budget=budget, ep=ep, etp=1,
                            loss_impl=loss, batch_size=mb, accum_reduce=accum)
            c = settled(cfg, **settings)
            try:
                validate(c)
                ParallelDims.from_config(c.parallel, world)
            except ConfigError:
                continue
            out.append(settings)
    return out


AC_SAVING = {"none": 0, "selective": 1, "op": 2, "block": 3}
"""How much activation memory each --ac mode saves, in order (measured by `loom plan`)."""


def ruled_out(c: JobConfig, oom_from: dict[tuple, int]) -> bool:
    """True when a traced key that needs no more memory than `c`'s runs out of it at a
    micro-batch <= c's even with the lightest compile setting. Lighter means: same tp, at
    least as many shards, at least as much recompute, and resharding when `c` does."""
    p = c.parallel
    for (tp, shard, ac, loss, reshard, *pipeline), mb in oom_from.items():
        if (tp == p.tp and shard >= p.dp_shard and loss == c.loss.loss_impl
                and pipeline == [p.pp, p.pp_microbatches, p.cp, p.ep, c.train.accum_reduce]
                and AC_SAVING[ac] >= AC_SAVING[p.activation_checkpoint]
                and (reshard == "always" or reshard == p.reshard_after_forward)
                and mb <= c.train.batch_size):
            return True
    return False


def first_oom(phases: list[dict[str, float]], c: JobConfig, device: PlanDevice,
              device_memory: int) -> int | None:
    """The smallest micro-batch at which `c`'s key runs out of memory even compiled at the
    lowest searched budget (None: every searched micro-batch fits that way)."""
    light = replace(c, parallel=replace(c.parallel, compile=True,
                                        act_mem_budget=min(b for _, b in COMPILE)))
    for mb in sorted(MICRO_BATCHES):
        sized = replace(light, train=replace(light.train, batch_size=mb))
        if scaled_peak(phases, sized, device) * GiB > device_memory:
            return mb
    return None


def global_tokens(c: JobConfig, world: int) -> int:
    """Tokens of one optimizer step over all ranks."""
    dims = ParallelDims.from_config(c.parallel, world)
    return (dims.global_batch_size(c.train.batch_size) * c.train.grad_accum_steps
            * c.data.seq_len)


def memory_key(c: JobConfig) -> tuple:
    p = c.parallel
    return (p.tp, p.dp_shard, p.activation_checkpoint, c.loss.loss_impl, p.reshard_after_forward,
            p.pp, p.pp_microbatches, p.cp, p.ep, c.train.accum_reduce)


def traced_batch(c: JobConfig) -> int:
    """The batch a key is traced at: one sample per (pipeline) micro-batch."""
    return max(1, c.parallel.pp_microbatches)


def scaled_peak(phases: list[dict[str, float]], c: JobConfig, device: PlanDevice) -> float:
    """Peak GiB of `c` from its key's eager phases at `traced_batch`: each phase's
    batch-proportional categories scaled, then the largest phase."""
    scale = c.train.batch_size / traced_batch(c)
    return max(finish({k: v * (scale if k in PER_SAMPLE else 1) for k, v in phase.items()},
                      c, device).peak_gib for phase in phases)


SEARCHED_FLAGS = {"--tp": 1, "--dp-replicate": 1, "--dp_replicate": 1, "--dp-shard": 1,
                  "--dp_shard": 1, "--ac": 1, "--activation-checkpoint": 1,
                  "--activation_checkpoint": 1, "--loss-impl": 1, "--loss_impl": 1,
                  "--reshard-after-forward": 1, "--reshard_after_forward": 1,
                  "--batch-size": 1, "--batch_size": 1, "--act-mem-budget": 1,
                  "--act_mem_budget": 1, "--compile": 0, "--no-compile": 0,
                  "--no-reshard-after-forward": 0, "--pp": 1, "--cp": 1,
                  "--pp-microbatches": 1, "--pp_microbatches": 1, "--pp-schedule": 1,
                  "--pp_schedule": 1, "--pp-stages-per-rank": 1, "--pp_stages_per_rank": 1,
                  "--ep": 1, "--etp": 1, "--accum-reduce": 1, "--accum_reduce": 1}


def unsearched(argv: list[str]) -> list[str]:
    """The user's train flags without those the search sets (`--flag value` or `--flag=v`)."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in SEARCHED_FLAGS:
            skip = 0 if "=" in arg else SEARCHED_FLAGS[name]
            continue
        out.append(arg)
    return out


def launch_line(c: JobConfig, world: int, base_argv: list[str]) -> str:
    p = c.parallel
    flags = [*unsearched(base_argv), "--tp", str(p.tp), "--dp-replicate", str(p.dp_replicate),
             "--dp-shard", str(p.dp_shard), "--ac", p.activation_checkpoint,
             "--loss-impl", c.loss.loss_impl, "--reshard-after-forward",
             p.reshard_after_forward, "--batch-size", str(c.train.batch_size)]
    if p.pp > 1:
        flags += ["--pp", str(p.pp), "--pp-schedule", p.pp_schedule,
                  "--pp-microbatches", str(p.pp_microbatches)]
    if p.cp > 1:
        flags += ["--cp", str(p.cp)]
    if p.ep > 1:
        flags += ["--ep", str(p.ep)]
    if p.compile:
        flags += ["--compile", "--act-mem-budget", str(p.act_mem_budget)]
    if len(reductions(c, p.pp)) > 1:
        flags += ["--accum-reduce", c.train.accum_reduce]
    return f"loom launch -n {world} loom train {shlex.join(flags)}"


def search(cfg: JobConfig, world: int, device_memory: int, device: PlanDevice, cache: Path,
           base_argv: list[str], as_json: bool) -> int:
    start, cpu_start = time.monotonic(), time.process_time()
    with fake_world(world):
        timed = sorted(((predict_step_time(c, world, device, cache), c)
                        for c in (settled(cfg, **s) for s in candidates(cfg, world))),
                       key=lambda sc: -global_tokens(sc[1], world) / sc[0].seconds)
        traced: dict[tuple, list[dict[str, float]]] = {}
        found, truncated = [], False
        oom_from: dict[tuple, int] = {}
        for step, c in timed:
            key = memory_key(c)
            if key not in traced:
                if ruled_out(c, oom_from):
                    continue
                if time.process_time() - cpu_start > TIME_BUDGET_S:
                    truncated = True
                    break
                one = replace(c, train=replace(c.train, batch_size=traced_batch(c)),
                              parallel=replace(c.parallel, compile=False))
                traced[key] = [in_gib(b) for b in traced_phases(one, world)]
                oom = first_oom(traced[key], c, device, device_memory)
                if oom is not None:
                    oom_from[key] = oom
            peak = scaled_peak(traced[key], c, device)
            if peak * GiB <= device_memory:
                found.append(dict(peak_gib=peak, step_time_s=step.seconds,
                                  tokens_per_s=global_tokens(c, world) / step.seconds,
                                  command=launch_line(c, world, base_argv)))
                if len(found) == TOP:
                    break
    elapsed = time.monotonic() - start
    if as_json:
        print(json.dumps(dict(results=found, traced_keys=len(traced), seconds=elapsed,
                              truncated=truncated)))
        return 0
    print(f"loom plan --search: {len(found)} fitting configurations, fastest first "
          f"(step time is an estimate); {len(traced)} memory traces in {elapsed:.0f} s"
          + (f", stopped at the {TIME_BUDGET_S:.0f} s CPU budget" if truncated else ""))
    for i, r in enumerate(found, 1):
        print(f"{i:>2}. {r['peak_gib']:6.2f} GiB  {r['step_time_s']:8.3g} s/step  "
              f"{r['tokens_per_s']:>12,.0f} tokens/s\n    {r['command']}")
    return 0
