"""`--lora-rank r`: low-rank adapters on the blocks' linears, as a model converter.

The converter swaps each targeted `nn.Linear` of every block for a `LoRALinear` (a subclass,
so the family's tensor-parallel plan, which names modules, still applies to it) and freezes
every other parameter. The base weight keeps its name, so the name-seeded init and a Hugging
Face folder fill it as before; the adapters are new parameters, `<linear>.lora_A` (r, in)
and `<linear>.lora_B` (out, r), drawn from the seed (B zero: the converted model starts as
the base one). The optimizer is built over trainable parameters only, so AdamW's state is
the adapters'.

Under tensor parallel the adapters are DTensors placed by the linear's own style:
ColwiseParallel shards every parameter of the module on dim 0 (B over the output features
like the base weight, A over the rank), RowwiseParallel shards only the base weight and
replicates A and B. DTensor's rules then give the same product as one process; the parity
test (`tests/parity/test_lora.py`) checks it at tp 2.

Targets are named by the family's own module names within a block (the spec's defaults,
or `--lora-targets`); resolution expands the shorthand and checks that every name is a
linear of the model, in one line, before anything is built.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loom.config import ConfigError, JobConfig
from loom.models.registry import for_config, for_model
from loom.models.resolve import plain_model
from loom.protocols.extensions import ModelConverter, register_converter

logger = logging.getLogger("loom")

MAX_RANK = 1 << 16
MAX_TARGETS = 64
TARGET = re.compile(r"[A-Za-z_]\w{0,63}(\.[A-Za-z_]\w{0,63}){0,7}")
"""A module path within a block, as a checkpoint may name one (read back by export)."""


@dataclass(frozen=True)
class LoraSettings:
    """What the adapted model's shapes and forward depend on (recorded in a checkpoint's
    architecture, read back by `loom export`)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @staticmethod
    def recorded(arch: dict[str, Any]) -> LoraSettings | None:
        """The settings a checkpoint's architecture records (`loom.checkpoint.resume.architecture`:
        rank, alpha as text, targets), or None for a full fine-tune; anything else is
        refused in one line."""
        if "lora_rank" not in arch:
            return None
        rank, alpha, targets = arch["lora_rank"], arch.get("lora_alpha"), arch.get("lora_targets")
        try:
            scale = float(alpha) if isinstance(alpha, str) and len(alpha) < 32 else math.nan
        except ValueError:
            scale = math.nan
        names = targets.split(",") if isinstance(targets, str) else []
        if not (type(rank) is int and 0 < rank <= MAX_RANK and 0 < scale < math.inf
                and 0 < len(names) <= MAX_TARGETS and all(map(TARGET.fullmatch, names))):
            raise ConfigError(f"unusable LoRA settings in the checkpoint: rank {rank!r}, "
                              f"alpha {alpha!r}, targets {str(targets)[:200]!r}")
        return LoraSettings(rank, scale, tuple(names))


def settings(cfg: JobConfig) -> LoraSettings:
    lo = cfg.lora
    return LoraSettings(lo.lora_rank, lo.lora_alpha, tuple((lo.lora_targets or "").split(",")),
                        lo.lora_dropout)


class LoRALinear(nn.Linear):
    """y = x W^T (+ b) + (alpha / r) * dropout(x) A^T B^T, with W (and b) frozen."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, dropout: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        factory = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **factory))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, rank, **factory))
        self.scale = scale
        self.dropout = dropout  # functional: TP's partition visits every child module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.dropout > 0:
            x = F.dropout(x, self.dropout, self.training)
        return out + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scale={self.scale:g}"


def blocks_of(model: nn.Module) -> nn.Module:
    """The family's block container (where every target lives)."""
    parts = for_model(model).parts
    return getattr(model, parts.blocks if parts is not None else "layers")


def expand_targets(given: str) -> tuple[str, ...]:
    """`attention.wq,wk,feed_forward.w1` -> attention.wq, attention.wk, feed_forward.w1: a
    name without a dot keeps the previous name's parent."""
    out: list[str] = []
    for item in (s.strip() for s in given.split(",")):
        if not item:
            raise ConfigError(f"--lora-targets {given!r}: an empty name")
        if "." not in item and out and "." in out[-1]:
            item = f"{out[-1].rsplit('.', 1)[0]}.{item}"
        if not TARGET.fullmatch(item):
            raise ConfigError(f"--lora-targets: {item!r} is not a module path")
        out.append(item)
    return tuple(dict.fromkeys(out))


def apply_lora(model: nn.Module, lora: LoraSettings) -> int:
    """Swap the targeted linears of every block for LoRALinear, in place (any device, meta
    included), and freeze every other parameter; returns how many linears were adapted."""
    for param in model.parameters():
        param.requires_grad_(False)
    swapped = 0
    for block in blocks_of(model).children():
        for target in lora.targets:
            parent_name, _, leaf = target.rpartition(".")
            if not _has(block, target):  # a block without this child (MoE) skips it
                continue
            parent = block.get_submodule(parent_name) if parent_name else block
            linear = getattr(parent, leaf)
            if type(linear) is nn.Linear:
                setattr(parent, leaf, LoRALinear(linear, lora.rank, lora.scale, lora.dropout))
                swapped += 1
    return swapped


def adapter_std(name: str, cfg: JobConfig) -> float | None:
    """Initial std of an adapter parameter (A: 1 / r, PEFT's "gaussian"; B: zeros, so the
    adapted model starts as the base one); None for every other parameter."""
    if name.endswith(".lora_A"):
        return 1.0 / cfg.lora.lora_rank
    if name.endswith(".lora_B"):
        return 0.0
    return None


def lora_targets_for(cfg: JobConfig) -> str | None:
    """--lora-targets expanded (or the family's defaults) and checked against the model
    (built on meta): a fact for the resolver (`loom.config.resolved.settled`). The flag as
    given without LoRA or on transformers' module (which `validate` refuses)."""
    if not cfg.lora.lora_rank or cfg.model.runs_transformers:
        return cfg.lora.lora_targets
    with torch.device("meta"):
        return checked_targets(cfg, plain_model(cfg))


def checked_targets(cfg: JobConfig, model: nn.Module) -> str | None:
    """--lora-targets expanded (the family's defaults when not given), checked against
    `model` (the plain model, on meta): one line for a name that is not a linear of some
    block. Without LoRA, the flag as given."""
    lo = cfg.lora
    if not lo.lora_rank:
        return lo.lora_targets
    spec = for_config(cfg.model)
    if lo.lora_targets is None and not spec.lora_targets:
        raise ConfigError(f"--lora-rank: the {spec.name} family names no default LoRA "
                          "targets; pass --lora-targets")
    blocks = list(blocks_of(model).children())
    targets = expand_targets(lo.lora_targets) if lo.lora_targets else \
        [t for t in spec.lora_targets if any(_has(b, t) for b in blocks)]  # this model's shape
    for target in targets:
        found = [m for b in blocks if _has(b, target)
                 for m in [b.get_submodule(target)] if type(m) is nn.Linear]
        if not found:
            raise ConfigError(f"--lora-targets: {target!r} is not a linear layer of the "
                              f"{spec.name} family's blocks (its defaults: "
                              f"{','.join(spec.lora_targets) or 'none'})")
        narrowest = min(min(m.in_features, m.out_features) for m in found)
        if lo.lora_rank > narrowest:  # B A of a (out, in) layer has rank <= min(out, in)
            raise ConfigError(f"--lora-rank {lo.lora_rank} exceeds {target}'s narrower side "
                              f"({narrowest}): a rank-r update of that layer is no more than "
                              f"a rank-{narrowest} one, at more memory")
    return ",".join(targets)


def _has(module: nn.Module, target: str) -> bool:
    try:
        module.get_submodule(target)
    except AttributeError:
        return False
    return True


def merged(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
           scale: float) -> torch.Tensor:
    """The plain linear's weight equal to an adapted one: W + scale * B A."""
    return weight + scale * (lora_b.to(weight.dtype) @ lora_a.to(weight.dtype))


@torch.no_grad()
def merge_adapters(model: nn.Module) -> None:
    """Fold every adapter into its base weight, in place, and zero B: the same function,
    as a merged export computes it (what a rounded export is compared with)."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.weight.copy_(merged(module.weight, module.lora_A, module.lora_B,
                                       module.scale))
            module.lora_B.zero_()


def adapted_weights(names: list[str]) -> dict[str, str]:
    """Base weight name -> its linear's prefix, for every adapted linear among `names`."""
    return {f"{n.removesuffix('.lora_A')}.weight": n.removesuffix(".lora_A")
            for n in names if n.endswith(".lora_A")}


def trainable_count(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameter elements of a (plain or converted) model."""
    return (sum(p.numel() for p in model.parameters() if p.requires_grad),
            sum(p.numel() for p in model.parameters()))


def convert(part: nn.Module, cfg: JobConfig) -> None:
    """The converter: adapt the part, freeze the rest, log what trains."""
    lora = settings(cfg)
    swapped = apply_lora(part, lora)
    trainable, total = trainable_count(part)
    logger.info("LoRA rank %d, alpha %g: %d linear layers adapted (%s); %.3fM of %.2fM "
                "parameters train", lora.rank, lora.alpha, swapped, ",".join(lora.targets),
                trainable / 1e6, total / 1e6)


register_converter(ModelConverter("lora", enabled=lambda cfg: cfg.lora.lora_rank > 0,
                                  convert=convert, added_std=adapter_std))
