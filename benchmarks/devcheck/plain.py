"""A plain PyTorch compiled training loop on loom's own model: the device check's floor.

    python3 benchmarks/devcheck/plain.py SPEC-JSON     # prints one JSON line last

SPEC: `flags` (the row's `loom train` flags: they build loom's model through loom's config,
so the shape is the row's by construction), steps, warmup, ac, compile, compile_backend.
What a user writes by hand: fp32 weights, bf16 autocast, each block torch.compile'd, eager
cross-entropy on the fp32 logits, gradient clipping at 1.0 (foreach), fused AdamW, no
metrics. --ac block wraps each block in non-reentrant checkpointing; op and selective save
every matmul and attention output (torch's selective checkpointing policy). Each step is
timed by device events (host clock after a synchronise off CUDA); no step reads the device.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

SRC = Path(__file__).resolve().parents[2] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from clock import StepClock  # noqa: E402  (run as a script: this folder is on the path)


def checkpointed(block: torch.nn.Module, ac: str) -> None:
    """Wrap `block.forward` in torch's activation checkpointing for loom's --ac `ac`."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    if ac == "none":
        return
    forward = block.forward
    kwargs: dict = {"use_reentrant": False}
    if ac in ("op", "selective"):
        save = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                torch.ops.aten._scaled_dot_product_flash_attention.default,
                torch.ops.aten._scaled_dot_product_efficient_attention.default,
                torch.ops.aten._scaled_dot_product_cudnn_attention.default}

        def policy(ctx, op, *args, **kw):
            return (CheckpointPolicy.MUST_SAVE if op in save
                    else CheckpointPolicy.PREFER_RECOMPUTE)

        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    block.forward = lambda *a, **kw: checkpoint(forward, *a, **kw, **kwargs)


def build(spec: dict, device: torch.device):
    import loom.families  # noqa: F401  (registers loom's model families)
    from loom.config import parse_args
    from loom.models.resolve import plain_model

    cfg = parse_args(spec["flags"])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = plain_model(cfg)
    model.to_empty(device=device)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    model.init_buffers(device)
    for block in model.layers.values():
        checkpointed(block, spec["ac"])
        if spec["compile"]:
            block.compile(backend=spec["compile_backend"])
    return cfg, model


def run(spec: dict) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    cfg, model = build(spec, device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95),
                            weight_decay=0.1, fused=True)
    batch, seq, vocab = cfg.train.batch_size, cfg.data.seq_len, cfg.model.vocab_size
    gen = torch.Generator().manual_seed(0)
    clock = StepClock(cuda)
    for _ in range(spec["steps"]):
        tokens = torch.randint(vocab, (batch, seq + 1), generator=gen).to(device,
                                                                         non_blocking=True)
        with clock.step():
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {**clock.summary(spec["warmup"]),
            "parameters": sum(p.numel() for p in model.parameters()),
            "alloc_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "loss_last": float(loss.detach()), "torch": torch.__version__}


def main() -> int:
    print(json.dumps(run(json.loads(sys.argv[1]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
