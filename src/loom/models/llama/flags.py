"""The Llama family's own flags: Llama 3.1's RoPE scaling, declared here with their defaults
and validation, and gathered by `loom.config` from the registered families."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loom.config.declare import SIZE, flag
from loom.errors import ConfigError


@dataclass(frozen=True)
class LlamaFlags:
    """Llama 3.1 RoPE scaling

    Taken by the llama, qwen3 and MoE families (all built of Llama blocks)."""

    rope_factor: float = flag(1.0, "Llama 3.1 RoPE scaling factor (1: no scaling)", ge=1)
    rope_low_freq_factor: float = flag(1.0, "Llama 3.1 RoPE scaling: low-frequency factor", gt=0)
    rope_high_freq_factor: float = flag(4.0, "Llama 3.1 RoPE scaling: high-frequency factor", gt=0)
    rope_original_max_seq_len: int = flag(8192, "Llama 3.1 RoPE scaling: the context length "
                                          "the model was pretrained at", **SIZE)

    def check(self, cfg: Any) -> None:
        """The blended band needs high > low (a Hugging Face model's are checked where its
        config is read)."""
        if cfg.model.from_hub_format or self.rope_factor == 1.0:
            return
        if not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise ConfigError(f"--rope-high-freq-factor {self.rope_high_freq_factor} must "
                              f"exceed --rope-low-freq-factor {self.rope_low_freq_factor} (with "
                              f"--rope-factor {self.rope_factor}, RoPE blends the band between "
                              "them)")
