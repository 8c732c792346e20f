"""Qwen3's attention flags (`--qk-norm`, `--head-dim`), declared here with their defaults and
validation, and gathered by `loom.config` from the registered families. loom's Llama blocks
implement both, so the llama and MoE families take them too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loom.config.declare import SIZE_MAX, flag
from loom.errors import ConfigError


@dataclass(frozen=True)
class Qwen3Flags:
    """Qwen3 attention

    The qwen3 families set them; loom's Llama blocks (llama, moe) take them too."""

    head_dim: int = flag(0, "width of one attention head (0: dim / n-heads)", le=SIZE_MAX)
    qk_norm: bool = flag(False, "RMSNorm each head's queries and keys before RoPE (Qwen3)")

    def check(self, cfg: Any) -> None:
        """The head width: --dim / --n-heads unless given, and even (RoPE rotates pairs)."""
        m = cfg.model
        if m.from_hub_format:  # its shape is the checkpoint's, checked where it is read
            return
        if m.dim % m.n_heads and not self.head_dim:
            raise ConfigError(f"--dim {m.dim} is not divisible by --n-heads {m.n_heads}")
        head_dim = self.head_dim or m.dim // m.n_heads
        if head_dim % 2:
            given = "--head-dim" if self.head_dim else "--dim / --n-heads"
            raise ConfigError(f"{given} = {head_dim} must be even: RoPE rotates pairs of "
                              "channels")
