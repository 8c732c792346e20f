"""An export checks itself before it is put in place: the folder loads in transformers (or
peft, for an adapter folder) without remote code, and its logits on a fixed batch match
loom's own model of the checkpoint, rounded to the exported dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from loom.config import ConfigError, ModelConfig
from loom.hf.export_files import DTYPES
from loom.hf.peft import peft_logits
from loom.hf.run_checkpoint import load_run_model
from loom.lora.converter import merge_adapters
from loom.models.transformers.model import load_hf_model

VERIFY_TOLERANCE = 1e-4
"""Largest |logit difference| / max |logit| accepted between transformers and loom."""


def verify_export(folder: Path, checkpoint: Path, dtype: str) -> float:
    """Load the export with transformers (CPU, no remote code) and compare its logits on a
    fixed batch with loom's own model of the checkpoint (its weights rounded to `dtype` as
    exported; a LoRA run's adapters merged first, as exported); returns the largest
    difference relative to the largest logit."""
    model, held = load_run_model(checkpoint)
    if held.lora is not None:
        merge_adapters(model)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.copy_(tensor.to(DTYPES[dtype]))
    hf = load_hf_model(ModelConfig(model=str(folder.resolve())))
    vocab = hf.hf.config.vocab_size
    tokens = torch.randint(vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf.eval()(tokens)
    return compare_logits(model, tokens, theirs, "transformers'")


def compare_logits(model: nn.Module, tokens: torch.Tensor, theirs: torch.Tensor,
                   whose: str) -> float:
    """The largest difference between loom's logits and `theirs`, relative to loom's
    largest; a ConfigError above the tolerance."""
    with torch.no_grad():
        ours = model.eval()(tokens).float()
    diff = float((ours - theirs.float()).abs().max() / ours.abs().max().clamp(min=1e-30))
    if not diff <= VERIFY_TOLERANCE:
        raise ConfigError(f"export check failed: {whose} logits differ from loom's by "
                          f"{diff:.2e} of the largest (tolerance {VERIFY_TOLERANCE:g}); "
                          "nothing was written")
    return diff


def check_peft(folder: Path, checkpoint: Path, base: str, dtype: str) -> float:
    """peft loads the adapter folder on the run's base folder with loom's logits (its
    adapters rounded to `dtype` as exported)."""
    model, _ = load_run_model(checkpoint)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if ".lora_" in name:
                tensor.copy_(tensor.to(DTYPES[dtype]))
    hf = load_hf_model(ModelConfig(model=base)).hf
    tokens = torch.randint(hf.config.vocab_size, (2, 16),
                           generator=torch.Generator().manual_seed(0))
    return compare_logits(model, tokens, peft_logits(folder, hf, tokens), "peft's")
