"""A GPT-2-style family defined and registered from the tests: learned positions, LayerNorm
with biases, a GELU (or ReLU: its own flag, `--gpt2-activation`) MLP, biased projections.
Nothing under src/ knows it; it trains under dp, tp and pp through its spec alone
(tests/integration/test_custom_family.py).

Importing this module registers the family as `gpt2-test`: one record, its spec with its
parallel plan (`loom.models.registry.register`), its preset (`--model gpt2-test-tiny`), the
layouts it runs and refuses, and its flag with `loom.config` (so `loom train --help`, a
`[model]` TOML table and `--print-config` hold it). Its checkpoints record its own six
arguments and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from loom.config import ConfigError, ModelConfig
from loom.config.declare import flag
from loom.models.context import ForwardContext, context_of
from loom.models.registry import register
from loom.models.spec import ModelParts, ModelPlan, ModelSpec
from loom.parallel.mesh import ParallelDims

ACTIVATIONS = {"gelu": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


@dataclass(frozen=True)
class GPT2Flags:
    """GPT-2 (test family)

    The family's own flag: declared here, gathered by loom's parser, TOML and --print-config."""

    gpt2_activation: str = flag("gelu", "gpt2-test: the MLP's activation",
                                choices=tuple(ACTIVATIONS))

    def check(self, cfg: Any) -> None:
        """Also for a config built in Python, which no parser's `choices` saw; context
        parallel has no attention core to replace here (`REFUSALS`)."""
        if cfg.model.family != "gpt2-test":
            return
        if cfg.parallel.cp > 1:
            raise ConfigError(f"--cp {cfg.parallel.cp}: the gpt2-test family's attention has "
                              "no core context parallel can replace; use --cp 1")
        if self.gpt2_activation not in ACTIVATIONS:
            raise ConfigError(f"--gpt2-activation {self.gpt2_activation!r}: choose "
                              f"{' or '.join(ACTIVATIONS)}")


@dataclass(frozen=True)
class GPT2Args:
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    max_seq_len: int
    gpt2_activation: str = "gelu"
    """Named as its flag, so a checkpoint's record restores it (`loom eval`, export)."""


def gpt2_args(m: ModelConfig) -> GPT2Args:
    return GPT2Args(m.dim, m.n_layers, m.n_heads, m.vocab_size, m.max_seq_len,
                    m.flags_of(GPT2Flags).gpt2_activation)


class Embeddings(nn.Module):
    """Token plus learned position embeddings, (B, T) -> (B, T, dim)."""

    def __init__(self, args: GPT2Args):
        super().__init__()
        self.wte = nn.Embedding(args.vocab_size, args.dim)
        self.wpe = nn.Embedding(args.max_seq_len, args.dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.wte(tokens) + self.wpe(positions)


class SelfAttention(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.q, self.v = nn.Linear(args.dim, args.dim), nn.Linear(args.dim, args.dim)
        # No key bias: softmax ignores a shift shared by every key, so its true gradient is
        # zero and AdamW would turn each layout's rounding noise into lr-sized steps.
        self.k = nn.Linear(args.dim, args.dim, bias=False)
        self.proj = nn.Linear(args.dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q, k, v = (f(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
                   for f in (self.q, self.k, self.v))  # (B, H, T, D); H local under tp
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class MLP(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.fc = nn.Linear(args.dim, 4 * args.dim)
        self.proj = nn.Linear(4 * args.dim, args.dim)
        self.activation = ACTIVATIONS[args.gpt2_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.activation(self.fc(x)))


class Block(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(args.dim), SelfAttention(args)
        self.ln_2, self.mlp = nn.LayerNorm(args.dim), MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.args = args
        self.embed = Embeddings(args)
        self.blocks = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.ln_f = nn.LayerNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """Ids -> logits, the hidden states where `ctx.hidden` or the head's loss where
        `ctx.head_apply` (fused-linear); it has no document mask to apply."""
        ctx = context_of(ctx)
        if ctx.documents is not None:
            raise ValueError("the gpt2 test family has no document mask")
        h = self.embed(tokens) if self.embed is not None else tokens
        for block in self.blocks.values():
            h = block(h)
        if self.ln_f is None:
            return h
        h = self.ln_f(h)
        if ctx.head_apply is not None:
            return ctx.head_apply(h, self.head.weight)
        return h if ctx.hidden else self.head(h)

    def init_std(self, name: str) -> float | None:
        if name.endswith("bias"):
            return 0.0
        if ".ln_" in name or name.startswith("ln_f"):
            return None
        return 0.02

    def init_buffers(self, device: torch.device) -> None:
        """No buffers."""


def gpt2_plan(model: GPT2) -> ModelPlan:
    def tensor_parallel(dims: ParallelDims, loss_parallel: bool) -> None:
        if not dims.tp_enabled:
            return
        mesh = dims.get_mesh("tp")
        outer = {"embed": PrepareModuleOutput(output_layouts=Replicate(),
                                              desired_output_layouts=Shard(1)),
                 "ln_f": SequenceParallel(),
                 "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
        parallelize_module(model, mesh, {k: v for k, v in outer.items()
                                         if getattr(model, k) is not None})
        for block in model.blocks.values():
            parallelize_module(block, mesh, {
                "ln_1": SequenceParallel(), "ln_2": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),)),
                "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),)),
                "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=Shard(1))})

    before = [] if model.embed is None else [model.embed]
    after = [] if model.ln_f is None else [[model.ln_f, model.head]]
    return ModelPlan(model, model.blocks, "GPT2 (test family)", attention="attn",
                     before=before, after=after, tensor_parallel=tensor_parallel)


PRESETS = {"gpt2-test-tiny": dict(family="gpt2-test", dim=64, n_layers=2, n_heads=4,
                                 vocab_size=256, seq_len=32, batch_size=4)}
"""The family's own preset: one complete row."""

LAYOUTS = ("dp_shard", "tp", "pp-1f1b", "dp_shard checkpoint resumed at tp")
"""What tests/integration/test_custom_family.py runs against one process."""

REFUSALS = ("context parallel (`--cp`): its attention has no core to replace "
            "(`GPT2Flags.check`)",)

GPT2_SPEC = register(ModelSpec(
    name="gpt2-test", model_cls=GPT2, args_from_config=gpt2_args, build=GPT2,
    args_cls=GPT2Args, presets=PRESETS, layouts=LAYOUTS, refusals=REFUSALS,
    parts=ModelParts(embedding="embed", blocks="blocks", head=("ln_f", "head"), output="head",
                     attention="attn", attention_core=None, feed_forward=("mlp",)),
    flags=(GPT2Flags,), uses=frozenset({"dim", "n_layers", "n_heads", "vocab_size",
                                        "max_seq_len", "gpt2_activation"})),
    plan=gpt2_plan)
