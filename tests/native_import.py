"""A transformers-built folder loaded into loom's native family as `loom train` loads it,
and its logits compared with transformers' own (the HF import tests of every family)."""

from __future__ import annotations

from pathlib import Path

import torch

from loom.config import parse_args
from loom.hf.checkpoint import HFCheckpoint
from loom.models.registry import for_config
from loom.models.resolve import plain_model
from loom.parallel.init import clean_name, load_weights
from loom.trainer.resolve import resolve_model


def imported(folder: Path, *argv: str):
    """(resolved config, loom's model of `folder` with its weights, in eval mode); `argv`:
    more flags."""
    cfg = resolve_model(parse_args(["--model", str(folder), "--seq-len", "32", "--fp32",
                                    *argv]))
    with torch.device("meta"):
        model = plain_model(cfg)
    spec = for_config(cfg.model)
    checkpoint = HFCheckpoint(folder, spec.hf[0], spec.args_from_config(cfg.model))
    checkpoint.check(model, clean_name)
    load_weights(model, torch.device("cpu"), checkpoint.read, fresh=checkpoint.fresh)
    return cfg, model.eval()


def assert_logits_equal_transformers(model: torch.nn.Module, folder: Path, rtol: float):
    """loom's logits on two random rows within `rtol` (of the largest) of transformers'
    model of `folder`; -> (transformers' model, the rows) for further checks."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(input_ids=tokens).logits
    diff = float((ours - theirs).abs().max() / theirs.abs().max())
    assert diff <= rtol, diff
    return hf, tokens
