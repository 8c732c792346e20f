"""Hugging Face causal LMs (`--model owner/repo` or a local model folder) as loom models.

`transformers` is imported only on this path. The weights are kept in fp32 and trained
under the same mixed-precision policy as loom's own models (bf16 compute, fp32 master
weights; `--fp32` turns bf16 off): AdamW on bf16 weights would drop small updates. A gated
repo's token comes from HF_TOKEN or HUGGING_FACE_HUB_TOKEN, read by `huggingface_hub`
itself, so loom never sees or logs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from loom.config import ConfigError, JobConfig, ModelConfig
from loom.data.hub import ensure_hub_reachable, first_line, looks_like_hub_id
from loom.models.hf_folder import CONFIG, HFFolder, open_folder, read_config

LOCAL_MODEL_HINT = "pass a local model folder (saved with save_pretrained) instead"


def hf_source(name: str, probe: bool = True) -> str:
    """A local model folder, or a hub id the hub answers for (`probe`); else a one-line
    ConfigError within seconds (the libraries would retry an unreachable hub for minutes)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"--model {name}: the folder has no config.json "
                              "(not a Hugging Face model folder)")
        return str(path)
    if not looks_like_hub_id(name):
        raise ConfigError(f"--model {name}: no such folder, and not a Hugging Face repo id")
    if probe:
        ensure_hub_reachable(name, "model", "--model", LOCAL_MODEL_HINT)
    return name


def _loading(name: str, load: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a `from_pretrained`/`from_config`, turning what a user can cause into one line."""
    try:
        return load(*args, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        hint = ("pass --trust-remote-code if you trust the code the repo ships"
                if "trust_remote_code" in str(e) else LOCAL_MODEL_HINT)
        raise ConfigError(f"--model {name}: cannot load it ({first_line(e)}); {hint}") from None


def load_hf_config(m: ModelConfig, cached: bool = False) -> Any:
    """The model's `PretrainedConfig` (only config.json is downloaded); `cached`: from the
    local cache only, once a node's first rank has fetched it. A local folder's config.json
    is checked by the folder reader before transformers parses it."""
    from transformers import AutoConfig

    source = hf_source(m.model, probe=not cached)
    if Path(source).is_dir():
        read_config(Path(source) / CONFIG)
    return _loading(m.model, AutoConfig.from_pretrained, source,
                    trust_remote_code=m.trust_remote_code, local_files_only=cached)


_SHAPE_FIELDS = {"vocab_size": "vocab_size", "dim": "hidden_size",
                 "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
                 "n_kv_heads": "num_key_value_heads", "max_seq_len": "max_position_embeddings"}
"""loom's model fields filled from the HF config where it has them (recorded in config.json)."""


def hf_shape(cfg: JobConfig, hf_config: Any) -> dict[str, int]:
    """The HF model's own shape (the vocabulary above all), by flag name; `cfg`'s --seq-len
    must fit in it."""
    shape = {ours: getattr(hf_config, theirs) for ours, theirs in _SHAPE_FIELDS.items()
             if isinstance(getattr(hf_config, theirs, None), int)}
    if "n_heads" in shape:  # no grouped-query attention: every head has its own keys
        shape.setdefault("n_kv_heads", shape["n_heads"])
    limit = shape.get("max_seq_len")
    if limit is not None and cfg.data.seq_len > limit:
        raise ConfigError(f"--seq-len {cfg.data.seq_len} exceeds the model's "
                          f"max_position_embeddings {limit}")
    return shape


class HFCausalLM(nn.Module):
    """Adapts a HF causal LM to loom's model contract: tokens (B, T) -> logits (B, T, V).

    The KV cache is never built: training does not read it, and it would hold every
    layer's keys and values until the step ends.
    """

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf
        self.hf.config.use_cache = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=tokens, use_cache=False).logits


def load_hf_model(m: ModelConfig) -> HFCausalLM:
    """The pretrained model on the CPU, read straight into fp32, the dtype of the trained
    (master) weights whatever dtype it was saved in, so no second copy is made; in training
    mode (dropout as configured)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per rank; loom prints its own setup lines
    source = hf_source(m.model)
    if Path(source).is_dir():
        check_weights_hold_model(m, open_folder(Path(source)))
    hf = _loading(m.model, AutoModelForCausalLM.from_pretrained, source,
                  trust_remote_code=m.trust_remote_code, dtype=torch.float32,
                  use_safetensors=True)  # never a pickle, even one torch would refuse
    return HFCausalLM(hf.train())


def check_weights_hold_model(m: ModelConfig, folder: HFFolder) -> None:
    """The model config.json describes (built on the meta device: nothing allocated) has no
    more weights than the folder's safetensors hold, so an inflated config.json fails here
    instead of allocating its model."""
    with torch.device("meta"):
        skeleton = hf_model_from_config(m)
    needed = sum(p.numel() for p in skeleton.parameters())
    if needed > folder.stored_elements:
        raise ConfigError(f"{folder.path / CONFIG}: its sizes describe {needed:,} weights, "
                          f"the folder's safetensors hold {folder.stored_elements:,}; nothing "
                          "was allocated")


def hf_model_from_config(m: ModelConfig, dtype: torch.dtype | None = None) -> HFCausalLM:
    """The same architecture with fresh weights and no download: on the meta device, the
    skeleton that pretrained weights are broadcast into; under fake tensors, for FLOP
    counting (`dtype` None: the default; casting fake parameters fails)."""
    from transformers import AutoModelForCausalLM

    kwargs = {} if dtype is None else {"dtype": dtype}
    hf = _loading(m.model, AutoModelForCausalLM.from_config, load_hf_config(m, cached=True),
                  trust_remote_code=m.trust_remote_code, **kwargs)
    return HFCausalLM(hf)
