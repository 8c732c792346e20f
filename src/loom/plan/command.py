"""`loom plan [train flags] --world-size N --device-memory SIZE [--device D] [--json]
[--search]`: will this job fit, and how fast will a step be? No accelerator, no peers.
`loom plan --failures --world-size N [...]`: what failures cost it (`loom.plan.failures`)."""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from loom.config import ConfigError, JobConfig, parse_args, validate
from loom.config.plan_flags import parse_plan_flags
from loom.config.resolved import settled
from loom.data.cache import default_cache_dir
from loom.lora.converter import lora_targets_for
from loom.losses import loss_impl_for
from loom.models.registry import for_config, routing_of
from loom.models.resolve import model_args
from loom.numerics.precision import resolve_precision
from loom.observability.devices import known_device
from loom.parallel.mesh import ParallelDims
from loom.plan.device import PlanDevice, plan_device
from loom.plan.failures import failures_main
from loom.plan.peaks import predict_memory
from loom.plan.search import search
from loom.plan.speed import param_count, predict_step_time
from loom.plan.trace import fake_world
from loom.runtime.logs import logging_scope
from loom.runtime.scope import logger_levels
from loom.trainer.resolve import resolve_model

logger = logging.getLogger("loom")

UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
    """'64GiB', '80GB', '512MiB', '64G' (binary) -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).lower() not in UNITS:
        raise ConfigError(f"--device-memory {text!r} is not a size like 64GiB, 80GB or 512MiB")
    size = float(match.group(1)) * UNITS[match.group(2).lower()]
    if size <= 0:
        raise ConfigError(f"--device-memory must be > 0, got {text!r}")
    return int(size)


@dataclass(frozen=True)
class Plan:
    peak_gib: float
    fits: bool
    breakdown: dict[str, float]
    step_time_s: float
    tokens_per_s: float
    device_memory_gib: float
    world_size: int
    layout: dict[str, int]
    parameters: int = 0
    """Every parameter of the model (routed experts, MTP modules included)."""
    active_parameters: int = 0
    """Those one token multiplies (its family's count: routed experts by top-k / E)."""

    def verdict(self) -> str:
        return "fits" if self.fits else f"OOM (needs {self.peak_gib:.2f} GiB)"


def planned_dtype(requested: str, device: str) -> str:
    """`--dtype auto` as a run on `device` would resolve it: the datasheet accelerators
    compute in bf16; for the CPU, this machine's CPU decides."""
    if requested != "auto":
        return requested
    if device == "cpu":
        return resolve_precision("auto", torch.device("cpu")).dtype
    return "bf16"


def planned_collectives(requested: str, device: str) -> str:
    """FSDP's collectives as a run on `device` makes them: accelerator backends keep torch's
    own; on CPU, gloo takes loom's pairwise exchange unless the user turned it off. (Traced
    pairwise at 2048 fake ranks, every collective is 2047 sends: 110 s for moe-671b.)"""
    return requested if device == "cpu" else "native"


def check_supported(cfg: JobConfig) -> None:
    """What the fake trace cannot follow yet, said before any work."""
    m, p = cfg.model, cfg.parallel
    if m.runs_transformers:
        raise ConfigError(f"loom plan traces native families, not transformers' module of "
                          f"{m.model}")
    if routing_of(m) and p.pp > 1:
        raise ConfigError("loom plan cannot model --pp with a mixture-of-experts model yet")
    if routing_of(m) and p.dtype == "fp32":
        raise ConfigError("loom plan cannot trace fp32 experts yet (their per-expert loop "
                          "splits rows by data-dependent counts); use --dtype bf16")


def check_device(cfg: JobConfig, name: str) -> None:
    """--float8 on a device loom's table does not hold: its float8 peak is not among the
    figures a user gives, and the plan does not guess it."""
    if cfg.parallel.float8 != "off" and known_device(name) is None:
        raise ConfigError(f"--float8 on --device {name!r}: loom's device table has no float8 "
                          "peak for it; plan it without --float8")


def planned_doc_mask(cfg: JobConfig, device: str) -> bool:
    """--doc-mask as the trace should see it for `cfg` on `device`. On an accelerator,
    a --compile run of a family whose attention takes FlexAttention's block mask builds
    that (a few bytes per 128 x 128 block) in place of the dense B x 1 x T x T mask the
    CPU trace would build and count (B T^2 bytes: 4 GiB at batch 4, seq 32k), so the plan
    traces such a run without a mask. Context parallel keeps its dense row-shard mask."""
    if device == "cpu" or not (cfg.data.doc_mask and cfg.parallel.compile) \
            or cfg.parallel.cp > 1:
        return cfg.data.doc_mask
    return not for_config(cfg.model).flex_doc_mask


def make_plan(cfg: JobConfig, world_size: int, device_memory: int, device: PlanDevice,
              cache: Path) -> Plan:
    """Predict one configuration (validated, effective --loss-impl); needs `fake_world`."""
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    memory = predict_memory(cfg, world_size, device)
    step = predict_step_time(cfg, world_size, device, cache)
    tokens = dims.global_batch_size(cfg.train.batch_size) * cfg.train.grad_accum_steps
    return Plan(peak_gib=memory.peak_gib, fits=memory.peak_gib * 2**30 <= device_memory,
                breakdown=memory.breakdown_gib, step_time_s=step.seconds,
                tokens_per_s=tokens * cfg.data.seq_len / step.seconds,
                device_memory_gib=device_memory / 2**30, world_size=world_size,
                layout={**dims.degrees, "ep": dims.ep}, **parameter_counts(cfg))


def parameter_counts(cfg: JobConfig) -> dict[str, int]:
    """The model's parameters, all and per token (a dense family's are the same)."""
    total, _ = param_count(cfg.model)
    active = for_config(cfg.model).active_params
    return {"parameters": total,
            "active_parameters": total if active is None else active(model_args(cfg))}


def report(plan: Plan, cfg: JobConfig, device: str) -> str:
    lines = [f"loom plan: {cfg.model.model or 'custom'} on {plan.world_size} ranks "
             f"{plan.layout}, batch {cfg.train.batch_size} x seq {cfg.data.seq_len}",
             f"parameters: {plan.parameters / 1e9:.2f}B, {plan.active_parameters / 1e9:.2f}B "
             "active per token",
             "per-rank peak memory (worst rank, predicted):"]
    lines += [f"  {name:<16}{gib:9.3f} GiB" for name, gib in sorted(plan.breakdown.items())]
    lines.append(f"  {'total':<16}{plan.peak_gib:9.3f} GiB of {plan.device_memory_gib:.2f} "
                 f"GiB: {plan.verdict()}")
    lines.append(f"step time (estimate, {device}): {plan.step_time_s:.3g} s, "
                 f"{plan.tokens_per_s:,.0f} tokens/s")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    """Exit 0 when the plan was made (fitting or not), 2 on bad input."""
    if "--failures" in argv:  # a model of the job's failures: no train flags, no trace
        return failures_main(argv)
    with logging_scope(0, stream=sys.stderr), \
            logger_levels({"loom": logging.WARNING}):  # not each traced build's lines
        return plan_main(argv)  # stdout holds the plan alone


def plan_main(argv: Sequence[str]) -> int:
    try:
        options, train_argv = parse_plan_flags(list(argv))
        device_memory = parse_size(options.device_memory)
        device = plan_device(options.device, options.device_peak_tflops,
                             options.device_bandwidth, options.device_memory_bandwidth)
        cfg = resolve_model(parse_args(train_argv))
        cfg = settled(cfg, lora_targets=lora_targets_for(cfg))
        validate(cfg)  # the model a Hugging Face folder filled in, checked as train checks it
        p = cfg.parallel
        cfg = replace(cfg, parallel=replace(
            p, dtype=planned_dtype(p.dtype, options.device),
            gloo_collectives=planned_collectives(p.gloo_collectives, options.device)))
        ParallelDims.from_config(cfg.parallel, options.world_size)
        check_supported(cfg)
        check_device(cfg, options.device)
        cfg = settled(cfg, loss_impl=loss_impl_for(cfg))
        cfg = settled(cfg, doc_mask=planned_doc_mask(cfg, options.device))
        if routing_of(cfg.model):
            print("warning: loom plan's MoE memory figures are validated on moe-debug only "
                  "(docs/planning.md)", file=sys.stderr, flush=True)
        if cfg.parallel.data_parallel == "simple-fsdp":
            print("note: loom plan traces --data-parallel simple-fsdp as FSDP2 (the same "
                  "shards; its gathers taken as FSDP2's per-block unshard)", file=sys.stderr,
                  flush=True)
        cache = Path(cfg.data.cache_dir).expanduser() if cfg.data.cache_dir else \
            default_cache_dir()
        if options.search:
            return search(cfg, options.world_size, device_memory, device,
                          cache, train_argv, as_json=options.json)
        with fake_world(options.world_size):
            plan = make_plan(cfg, options.world_size, device_memory, device, cache)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(json.dumps(asdict(plan)) if options.json else report(plan, cfg, options.device))
    return 0
