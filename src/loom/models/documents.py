"""Packed documents as attention sees them (--doc-mask): each token's position within its
document and the block-diagonal causal mask, from per-token document indices.

The mask is either a dense (B, 1, T, T) bool tensor for SDPA, which costs O(T^2) memory and
loses SDPA's flash kernels, or FlexAttention's block mask, which skips whole blocks of
keys outside a query's document. Flex only pays compiled (its eager form is a dense
reference) and torch 2.13 has no backward for it on the CPU, so the block mask is used
where `flex` is asked (a compiled run) and attention can train there (`flex_fits`)."""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask


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


def flex_fits(device: torch.device) -> bool:
    """Whether FlexAttention can run here now: any device torch gives it kernels for, the
    CPU and MPS only without gradients (torch has no flex backward there)."""
    return device.type not in ("cpu", "mps") or not torch.is_grad_enabled()


def block_document_mask(documents: torch.Tensor) -> BlockMask:
    """(B, T) document indices -> FlexAttention's block mask of `document_mask` (the same
    predicate, evaluated per block: blocks wholly outside a document are never computed)."""
    batch, seqlen = documents.shape

    def same_document_causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
                             kv: torch.Tensor) -> torch.Tensor:
        return (documents[b, q] == documents[b, kv]) & (kv <= q)

    return create_block_mask(same_document_causal, batch, None, seqlen, seqlen,
                             device=documents.device)


def attention_mask(documents: torch.Tensor, flex: bool) -> torch.Tensor | BlockMask:
    """The document mask in the form attention takes here: a block mask where `flex` is
    asked and fits the device, else the dense one."""
    return block_document_mask(documents) if flex and flex_fits(documents.device) \
        else document_mask(documents)


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
