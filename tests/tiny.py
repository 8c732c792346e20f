"""The tiny loom model the unit tests build on the CPU: seeded, norm weights 1, every other
weight from the model's own init std, so the tests need no process group."""

from __future__ import annotations

import torch

from loom.models.llama.model import ModelArgs, Transformer


def tiny_model(args: ModelArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = model.init_std(name)
            p.fill_(1.0) if std is None else p.normal_(0, std)
    return model
