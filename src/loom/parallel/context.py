"""Context parallel: each sequence split across the `cp` ranks, attention over all of it.

Load-balanced causal sharding: the sequence is cut into 2 x cp chunks and cp rank r keeps
chunks r and 2cp-1-r, so every rank's queries see the same number of causal keys. Tokens,
labels and RoPE positions are sharded the same way. Attention all-gathers K and V (at GQA
width) across cp with autograd, so the backward reduce-scatters their gradients, and runs
causal attention of the local queries against the prefix each chunk may see, the approach
of Llama 3's long-context training. It needs no sharding rule for the attention kernel, so
it works on every device (torch's own ring attention does not run on CPU).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from loom.compat import all_gather_autograd
from loom.models.context import context_of
from loom.models.documents import shard_document_mask
from loom.models.registry import for_model
from loom.models.spec import ModelParts
from loom.parallel.mesh import ParallelDims

logger = logging.getLogger("loom")

Batch = dict[str, torch.Tensor]


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two of the 2 x cp sequence chunks that cp rank `rank` holds."""
    return rank, 2 * cp - 1 - rank


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's shard of x along `dim`: chunks r and 2cp-1-r, concatenated."""
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(cp, rank)], dim=dim)


def unshard_sequence(x: torch.Tensor, cp: int, dim: int = 1) -> torch.Tensor:
    """Global order from the shards of ranks 0 ... cp-1 concatenated along `dim`: the first
    chunks of ranks 0 ... cp-1, then the second chunks of ranks cp-1 ... 0."""
    pieces = x.unflatten(dim, (cp, 2, -1))
    first, second = pieces.select(dim + 1, 0), pieces.select(dim + 1, 1).flip(dim)
    return torch.cat([first, second], dim=dim).flatten(dim, dim + 1)


def shard_positions(seq_len: int, cp: int, rank: int,
                    device: torch.device | None = None) -> torch.Tensor:
    """Global positions (seq_len // cp,) of this rank's tokens."""
    return shard_sequence(torch.arange(seq_len, device=device), cp, rank, dim=0)


def causal_offset_mask(q_len: int, k_len: int, offset: int,
                       device: torch.device | None = None) -> torch.Tensor:
    """(q_len, k_len) bool, True where query i (global position offset + i) may attend key j
    (global position j): j <= offset + i."""
    q = torch.arange(q_len, device=device)[:, None] + offset
    return torch.arange(k_len, device=device)[None, :] <= q


def shard_batch(batch: Batch, dims: ParallelDims) -> Batch:
    """The cp rank's shard of a loader batch (every cp rank of a dp rank gets the same
    samples); unchanged without context parallel."""
    if not dims.cp_enabled:
        return batch
    rank = dims.get_mesh("cp").get_local_rank()
    return {k: shard_sequence(v, dims.cp, rank) for k, v in batch.items()}


class _PrefixCausalCPU(torch.autograd.Function):
    """Queries that see every `prefix` key and the `diag` keys causally, on the CPU: two
    flash attentions (no mask tensor) merged by their log-sum-exp. The backward runs each
    with the merged output and log-sum-exp, which gives the exact gradients (as ring
    attention does). Tensors are (B, H, L, D)."""

    @staticmethod
    def forward(ctx, q, k_prefix, v_prefix, k_diag, v_diag):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out1, lse1 = flash(q, k_prefix, v_prefix, 0.0, False)
        out2, lse2 = flash(q, k_diag, v_diag, 0.0, True)
        lse = torch.logaddexp(lse1, lse2)
        out = (out1 * (lse1 - lse).exp().unsqueeze(-1)
               + out2 * (lse2 - lse).exp().unsqueeze(-1)).to(q.dtype)
        ctx.save_for_backward(q, k_prefix, v_prefix, k_diag, v_diag, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k_prefix, v_prefix, k_diag, v_diag, out, lse = ctx.saved_tensors
        flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        dq1, dk_prefix, dv_prefix = flash_backward(grad, q, k_prefix, v_prefix, out, lse,
                                                   0.0, False)
        dq2, dk_diag, dv_diag = flash_backward(grad, q, k_diag, v_diag, out, lse, 0.0, True)
        return dq1 + dq2, dk_prefix, dv_prefix, dk_diag, dv_diag


def prefix_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            merged: bool | None = None) -> torch.Tensor:
    """Attention of the last L positions q (B, H, L, D) over keys k, v (B, H, S, D): query i
    sees keys 0 ... S-L+i. On the CPU (`merged`) without a mask tensor, which would cost
    L x S floats per layer; elsewhere with an explicit mask."""
    size, prefix = q.shape[2], k.shape[2] - q.shape[2]
    if prefix == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if q.device.type == "cpu" if merged is None else merged:
        return _PrefixCausalCPU.apply(q, k[:, :, :prefix], v[:, :, :prefix],
                                      k[:, :, prefix:], v[:, :, prefix:])
    mask = causal_offset_mask(size, k.shape[2], prefix, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def sharded_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int,
                             rank: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of cp rank `rank`'s queries q (B, T/cp, H, D), in load-balanced
    order, against the whole sequence's k and v (B, T, Hkv, D), in global order. Chunk c
    attends to keys 0 ... (c+1)·len - 1 only, so no rank computes masked-out blocks.
    `mask` (B, 1, T/cp, T), rows in the queries' order: the document mask (--doc-mask),
    which replaces the causal one."""
    n_rep = q.shape[2] // k.shape[2]
    size = q.shape[1] // 2
    outs = []
    for local, chunk in enumerate(chunk_ids(cp, rank)):
        end = (chunk + 1) * size
        keys = k[:, :end].repeat_interleave(n_rep, dim=2).transpose(1, 2)
        values = v[:, :end].repeat_interleave(n_rep, dim=2).transpose(1, 2)
        rows = slice(local * size, (local + 1) * size)
        queries = q[:, rows].transpose(1, 2)
        if mask is None:
            out = prefix_causal_attention(queries, keys, values)
        else:
            out = F.scaled_dot_product_attention(queries, keys, values,
                                                 attn_mask=mask[:, :, rows, :end])
        outs.append(out.transpose(1, 2))
    return torch.cat(outs, dim=1)


def gather_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """(B, T/cp) shards of the cp ranks (token ids, no gradient) -> (B, T) in global
    order: what the step needs to find documents that span shards (--doc-mask)."""
    shards = [torch.empty_like(x) for _ in range(mesh.size())]
    dist.all_gather(shards, x.contiguous(), group=mesh.get_group())
    return unshard_sequence(torch.cat(shards, dim=1), mesh.size(), dim=1)


class ContextParallelAttention(nn.Module):
    """Causal attention of this rank's two query chunks against the cp-gathered K and V.

    Drop-in for the model's `attention.core`: the same (q, k, v) -> out contract, with
    q, k, v this rank's shard (B, T/cp, heads, D) in load-balanced order.
    """

    def __init__(self, mesh: DeviceMesh):
        super().__init__()
        self.mesh, self.cp, self.rank = mesh, mesh.size(), mesh.get_local_rank()

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T/cp, Hkv, D) shard -> (B, T, Hkv, D) in global order; the backward sums the
        gradient of every rank's use of this shard (a reduce-scatter)."""
        full = all_gather_autograd(x.transpose(0, 1).contiguous(), 0, self.mesh)
        return unshard_sequence(full, self.cp, dim=0).transpose(0, 1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        return sharded_causal_attention(q, self.gather(k), self.gather(v), self.cp, self.rank,
                                        mask)


def sum_over_cp(mesh: DeviceMesh) -> Callable[[torch.Tensor], torch.Tensor]:
    """Sums of per-sequence quantities over the cp ranks, each holding part of every
    sequence: an all-reduce whose backward all-reduces the gradient too, so each rank's
    partial sums get the gradient every rank's use of the total sends them. Every cp rank
    then adds the same whole-sequence term to its loss and the gradient average over
    dp x cp counts it once (the cp ranks' shares sum to it)."""
    def summed(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x, "sum", mesh)

    return summed


def _add_positions(mesh: DeviceMesh, tp: int
                   ) -> Callable[[nn.Module, tuple, dict], tuple[tuple, dict]]:
    """Forward pre-hook of the model: add to its `ctx` (`ForwardContext`) the global RoPE
    positions of this rank's tokens; under --doc-mask, given the whole sequence's
    `documents` (B, T), their positions within their documents and their rows of the
    document mask instead. A later pipeline stage gets hidden states, which tensor parallel
    also shards along the sequence (by `tp`)."""
    cp, rank = mesh.size(), mesh.get_local_rank()

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        tokens = args[0] if args else kwargs["tokens"]
        ctx = context_of(args[1] if len(args) > 1 else kwargs.get("ctx"))
        seq_len = tokens.shape[1] * cp * (tp if tokens.is_floating_point() else 1)
        index = shard_positions(seq_len, cp, rank, device=tokens.device)
        if ctx.documents is None:
            ctx = ctx.with_(positions=index, shard_index=index)
        else:
            positions, mask = shard_document_mask(ctx.documents, index)
            ctx = ctx.with_(positions=positions, mask=mask, shard_index=index, documents=None)
        return args[:1], {**kwargs, "ctx": ctx}

    return hook


def apply_cp(model: nn.Module, mesh: DeviceMesh, tp: int = 1,
             parts: ModelParts | None = None) -> None:
    """Swap every block's `attention.core` for the context-parallel one and make the model
    index RoPE by global position. The core has no parameters: names, init and checkpoints
    stay the same. `parts`: the family's (`parallelize` passes its plan's spec's); None:
    looked up from the model."""
    parts = for_model(model).parts if parts is None else parts
    if parts is None or parts.attention_core is None:
        raise ValueError(f"{type(model).__name__} names no attention core to replace")
    for block in getattr(model, parts.blocks).values():
        owner, _, name = parts.attention_core.rpartition(".")
        setattr(block.get_submodule(owner), name, ContextParallelAttention(mesh))
    model.register_forward_pre_hook(_add_positions(mesh, tp), with_kwargs=True)
    logger.info("context parallel: cp=%d, all-gather K/V, load-balanced causal chunks",
                mesh.size())
