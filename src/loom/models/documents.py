"""Packed documents as attention sees them (--doc-mask): each token's position within its
document and the block-diagonal causal mask, from per-token document indices."""

from __future__ import annotations

import torch


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) document indices -> (B, T) index of each token within its document."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) document indices -> (B, 1, T, T) bool: query i may attend key j when j <= i
    and both are in one document (block-diagonal causal; one mask serves every head)."""
    seqlen = documents.shape[1]
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=documents.device).tril()
    return ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]


def shard_document_mask(documents: torch.Tensor, index: torch.Tensor,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """For the tokens at global positions `index` (T',) of a sequence whose documents are
    `documents` (B, T): their positions within their documents (B, T') and the rows of the
    document mask for them as queries against every key (B, 1, T', T). A sequence shard
    (context parallel) attends with these."""
    keys = torch.arange(documents.shape[1], device=documents.device)
    same = documents[:, index, None] == documents[:, None, :]
    mask = same & (keys[None, :] <= index[:, None])
    return document_positions(documents)[:, index], mask[:, None]
