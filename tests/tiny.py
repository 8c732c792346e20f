"""The tiny loom model the unit tests build on the CPU: seeded, norm weights 1, every other
weight from the model's own init std, so the tests need no process group."""

from __future__ import annotations

import torch

from loom.models.llama.model import ModelArgs, Transformer


def tiny_model(args: ModelArgs, seed: int = 0, cls: type[Transformer] = Transformer
               ) -> Transformer:
    """`cls` (a Transformer or subclass, e.g. the MoE one) built from `args` on the CPU."""
    torch.manual_seed(seed)
    model = cls(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = model.init_std(name)
            p.fill_(1.0) if std is None else p.normal_(0, std)
    return model
