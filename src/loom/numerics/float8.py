"""`--float8 tensorwise|rowwise`: float8 matmuls through torchao, as a model converter.

The converter swaps the blocks' `nn.Linear` layers for torchao's `Float8Linear` on the meta
device, before tensor parallel and FSDP2 see the model, so the parameter names (and so the
init, the checkpoints and the export) are unchanged: a float8 run's checkpoint loads into a
bf16 run and back. What stays in `--dtype`, and why:
- the output head: its logits feed the loss directly, and torchtitan and torchao's own
  guidance leave it in high precision for accuracy;
- MoE router gates: a few experts wide (not a float8-sized matmul) and their scores decide
  routing, computed in fp32 on purpose;
- any linear whose two dims are not both multiples of 16 (the float8 GEMM's constraint).

Tensorwise scales let FSDP2 all-gather the weights in float8 (half the bytes of bf16); their
scales are then computed for every weight in one all-reduce after each optimizer step, by a
step hook (torchao's `precompute_float8_dynamic_scale_for_fsdp`).

Where it runs: CUDA compute capability >= 8.9 (Ada, Hopper and later have float8 tensor
cores). On CPU the float8 casts are emulated (high-precision matmuls of float8-rounded
operands) with an info line: the only way to exercise the plumbing and the numerics there.
On an older or other accelerator it is refused unless `--float8-emulate` asks for emulation.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from loom.config import JobConfig
from loom.errors import ConfigError
from loom.models.registry import for_config
from loom.protocols.extensions import (
    ModelConverter,
    StepContext,
    StepHook,
    register_converter,
    register_step_hook,
)
from loom.runtime.distributed import pick_device

logger = logging.getLogger("loom")

MIN_CAPABILITY = (8, 9)
"""float8 tensor cores: Ada (8.9), Hopper (9.0) and later."""
GEMM_MULTIPLE = 16
"""torch._scaled_mm needs both dims of a float8 weight divisible by 16."""


def emulate(cfg: JobConfig) -> bool:
    """Whether the float8 matmuls are emulated: asked for, or the CPU (which has no float8
    GEMM); refused (ConfigError) on an accelerator without float8 tensor cores unless asked."""
    if cfg.parallel.float8_emulate:
        return True
    device = pick_device(0)
    if device.type == "cpu":
        logger.info("--float8 %s on CPU: emulated (float8-rounded operands, high-precision "
                    "matmuls): the numerics of float8, none of its speed", cfg.parallel.float8)
        return True
    if device.type != "cuda":
        raise ConfigError(f"--float8 needs a CUDA device of compute capability >= 8.9, not "
                          f"{device.type}; --float8-emulate runs it emulated (for testing)")
    capability = torch.cuda.get_device_capability()  # this rank's, set by init_distributed
    if capability < MIN_CAPABILITY:
        raise ConfigError(f"--float8 needs CUDA compute capability >= 8.9 (float8 tensor "
                          f"cores), this GPU has {capability[0]}.{capability[1]}; "
                          "--float8-emulate runs it emulated (for testing)")
    return False


def float8_config(cfg: JobConfig, torchao_float8: Any) -> Any:
    """torchao's Float8LinearConfig for --float8: the named recipe, plus float8 all-gather
    under FSDP2 for tensorwise (torchao gathers float8 weights with one scale per tensor
    only; rowwise weights are gathered in --dtype)."""
    recipe = cfg.parallel.float8
    return dataclasses.replace(torchao_float8.Float8LinearConfig.from_recipe_name(recipe),
                               emulate=emulate(cfg),
                               enable_fsdp_float8_all_gather=recipe == "tensorwise")


def linear_filter(part: nn.Module, cfg: JobConfig) -> Callable[[nn.Module, str], bool]:
    """Which linears become float8 (torchao's filter: module, name): plain `nn.Linear`
    inside the family's blocks (so never the head, which sits after them), not a router
    gate, both dims multiples of 16."""
    spec = for_config(cfg.model)
    blocks = spec.parts.blocks if spec.parts is not None else None
    gates = {id(m) for m in spec.routers(part)}

    def keep(module: nn.Module, fqn: str) -> bool:
        return (type(module) is nn.Linear and fqn.split(".")[0] == blocks
                and id(module) not in gates
                and all(n % GEMM_MULTIPLE == 0 for n in module.weight.shape))
    return keep


def convert_to_float8(part: nn.Module, cfg: JobConfig) -> None:
    """Swap the part's eligible linears for torchao's Float8Linear, in place, on meta."""
    # torchao is an optional dependency (the float8 extra): imported only when --float8 is on.
    # Its import warns about each optional kernel library it cannot load (mxfp8 and CUTLASS
    # sm90a builds; float8 training uses neither) and torch about an enum it registers: the
    # run's log settings keep both loggers quiet unless --verbose (`loom.runtime.logs`).
    torchao_float8 = importlib.import_module("torchao.float8")
    config = float8_config(cfg, torchao_float8)
    keep = linear_filter(part, cfg)
    before = sum(type(m) is nn.Linear for m in part.modules())
    torchao_float8.convert_to_float8_training(part, module_filter_fn=keep, config=config)
    swapped = sum(isinstance(m, torchao_float8.float8_linear.Float8Linear)
                  for m in part.modules())
    logger.info("float8 (%s%s): %d of %d linear layers swapped (the head, router gates and "
                "dims not divisible by %d stay in high precision)", cfg.parallel.float8,
                ", emulated" if config.emulate else "", swapped, before, GEMM_MULTIPLE)


def precompute_scales(context: StepContext) -> dict[str, float]:
    """Tensorwise under FSDP2: every float8 weight's scale in one all-reduce per weight
    mesh after the update, instead of one per weight at each all-gather."""
    # torchao is an optional dependency: this hook is active only with --float8 tensorwise.
    torchao_float8 = importlib.import_module("torchao.float8")
    for group in by_weight_mesh(context.model, torchao_float8.float8_linear.Float8Linear):
        torchao_float8.precompute_float8_dynamic_scale_for_fsdp(group)
    return {}


def by_weight_mesh(model: nn.Module, float8_linear: type) -> list[nn.ModuleList]:
    """The model's sharded float8 linears grouped by their weight's mesh. torchao stacks
    every weight's amax into one DTensor, which takes a single mesh, and a plan may leave
    some linears whole on the tp ranks (DeepSeek-V3's low-rank down-projections are on the
    dp_shard mesh alone, the head-split ones on dp_shard x tp)."""
    groups: dict[Any, list[nn.Module]] = {}
    for module in model.modules():
        if isinstance(module, float8_linear) and isinstance(module.weight, DTensor):
            groups.setdefault(module.weight.device_mesh, []).append(module)
    return [nn.ModuleList(group) for group in groups.values()]


register_converter(ModelConverter(
    "float8", enabled=lambda cfg: cfg.parallel.float8 != "off", convert=convert_to_float8))
register_step_hook(StepHook(
    "float8-scales", enabled=lambda cfg: cfg.parallel.float8 == "tensorwise",
    run=precompute_scales))
