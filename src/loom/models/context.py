"""What a forward is handed besides its tokens: one declared record, `ForwardContext`.

A model's forward is `forward(tokens, ctx=None)`. Everything a parallel layout or the loss
gives the model travels in this record, built by the layout that knows it (the step
executor, the context-parallel hook, the pipeline schedule's stage adapter), so a model
never reads an attribute that the trainer set on it and its signature does not grow with
each layout. Each field says who sets it and what the model does with it; a model ignores
the fields its family has no use for (a family without MTP never reads `token_ids`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

HeadApply = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(hidden states, the head's weight) -> a loss computed on that weight (fused-linear)."""


@dataclass(frozen=True)
class ForwardContext:
    """What a layout hands one forward (None / False: the whole, plain sequence)."""

    positions: torch.Tensor | None = None
    """(T,) or (B, T): the global position of each token when `tokens` is a shard of longer
    sequences (context parallel, or within-document positions under --doc-mask); None:
    0 ... T-1."""
    documents: torch.Tensor | None = None
    """(B, T): each token's packed-document index (--doc-mask): a token attends only to its
    own document's earlier tokens. Every pipeline stage is given it."""
    mask: torch.Tensor | None = None
    """(B, 1, T, S): attention's mask for a sequence shard, prepared from the whole
    sequences' documents (context parallel's hook sets it with `positions`)."""
    flex_mask: bool = False
    """Build `documents`' mask as FlexAttention's block mask where the family's attention
    takes one and the device has kernels (the step sets it on compiled runs: flex's eager
    form is a dense reference, no cheaper than SDPA's mask)."""
    shard_index: torch.Tensor | None = None
    """(T',): the global positions of this shard's tokens (context parallel; `positions`
    may count from each document's start instead)."""
    token_ids: torch.Tensor | None = None
    """(B, T_whole): the micro-batch's ids, whole sequences: what a family whose later
    modules read ids ahead of a position (DeepSeek-V3's MTP depths) picks them from where
    `tokens` are hidden states (a later pipeline stage) or a shard (context parallel)."""
    hidden: bool = False
    """Return the final (normed) hidden states instead of logits: the loss projects through
    the head itself (fused-linear)."""
    depths: bool = False
    """Also return the family's extra prediction depths (`ModelSpec.depths`), stacked below
    the main rows: ((1 + D) * B, T, ...) in depth order. The criterion asks for them in
    training and scores depth d against the labels d ahead."""
    head_apply: HeadApply | None = None
    """A loss the head computes on its weight inside its own call, returned instead of
    logits (so the head's FSDP2 unit gathers once; `loom.losses.Criterion.model_loss`)."""

    def with_(self, **changes: object) -> ForwardContext:
        """A copy with `changes` (a layout adds what it knows to what it was given)."""
        return replace(self, **changes)


PLAIN = ForwardContext()
"""The whole, plain sequence: what `ctx=None` means."""


def context_of(ctx: ForwardContext | None) -> ForwardContext:
    return PLAIN if ctx is None else ctx
