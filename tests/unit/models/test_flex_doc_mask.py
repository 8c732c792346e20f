"""--doc-mask through FlexAttention's block mask: the same attention as the dense
(B, 1, T, T) mask, forward and gradients, in fp32, on a batch with several documents per
row; and the choice between them (compiled runs, devices where flex trains)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as flex
import torch.nn.functional as F

from loom.config import parse_args
from loom.models.context import ForwardContext
from loom.models.documents import attention_mask, block_document_mask, document_mask
from loom.models.llama.model import CausalAttention, ModelArgs
from loom.models.registry import family
from loom.parallel.mesh import ParallelDims
from loom.trainer.executor import build_executor
from loom.trainer.step import document_ids
from tests.tiny import tiny_model

EOT = 1
ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
                 max_seq_len=64)


def packed() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 40 tokens, four and three documents (a one-token one among them), and
    their document ids."""
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(2, ARGS.vocab_size, (2, 40), generator=gen)
    tokens[0, [6, 17, 18, 30]] = EOT
    tokens[1, [12, 25]] = EOT
    return tokens, document_ids(tokens, EOT)


def qkv() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(2, 40, 4, 8), (2, 40, 2, 8), (2, 40, 2, 8)]  # GQA: 4 query heads, 2 kv heads
    return [torch.randn(s, generator=gen).requires_grad_() for s in shapes]


def test_block_mask_is_the_dense_mask() -> None:
    """The block mask's predicate, at every (query, key), is the dense mask."""
    _, documents = packed()
    mask_mod = block_document_mask(documents).mask_mod
    b, q, kv = torch.meshgrid(torch.arange(2), torch.arange(40), torch.arange(40),
                              indexing="ij")
    assert torch.equal(mask_mod(b, torch.zeros_like(b), q, kv), document_mask(documents)[:, 0])


def test_flex_attention_matches_dense_forward_and_gradients(monkeypatch) -> None:
    """Gradients: torch 2.13 refuses flex backward on the CPU in its argument check only;
    lifting that check runs flex's reference backward, which is what the block mask
    changes (GPU kernels are torch's to test)."""
    monkeypatch.setattr(flex, "_validate_device", lambda *tensors: None)
    _, documents = packed()
    core = CausalAttention()
    q, k, v = qkv()
    dense = core(q, k, v, mask=document_mask(documents))
    ref_grads = torch.autograd.grad((dense * dense).sum(), (q, k, v))
    block = core(q, k, v, mask=block_document_mask(documents))
    grads = torch.autograd.grad((block * block).sum(), (q, k, v))
    torch.testing.assert_close(block, dense, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("whole", [True, False], ids=["whole-model", "per-block"])
def test_compiled_model_with_flex_matches_dense_and_does_not_recompile(whole: bool) -> None:
    """The model compiled with the block mask (no gradients: the CPU has no flex backward)
    equals the eager dense model, and a second batch of other documents reuses the
    graphs. Per block (FSDP2's layout) the mask is built eagerly and handed in."""
    model = tiny_model(ARGS)
    tokens, documents = packed()
    tokens2 = tokens.roll(7, dims=1)
    documents2 = document_ids(tokens2, EOT)
    with torch.no_grad():
        dense, dense2 = model(tokens, ctx=ForwardContext(documents=documents)), model(
            tokens2, ctx=ForwardContext(documents=documents2))
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        if whole:
            compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        else:
            for block in model.layers.values():
                block.compile(backend="aot_eager", fullgraph=True)
            compiled = model
        got = compiled(tokens, ctx=ForwardContext(documents=documents, flex_mask=True))
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        got2 = compiled(tokens2, ctx=ForwardContext(documents=documents2, flex_mask=True))
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got2, dense2, rtol=1e-5, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("grad", [True, False])
def test_the_mask_form_follows_the_ask_and_the_device(grad: bool) -> None:
    """On the CPU the block mask is used only without gradients; unasked, never."""
    _, documents = packed()
    with torch.set_grad_enabled(grad):
        assert isinstance(attention_mask(documents, flex=False), torch.Tensor)
        asked = attention_mask(documents, flex=True)
    assert isinstance(asked, torch.Tensor) if grad else isinstance(asked, flex.BlockMask)


def test_dense_mask_sdpa_reference() -> None:
    """The dense path is SDPA with the document mask: a query attends only to earlier keys
    of its own document (checked against a masked softmax written out)."""
    _, documents = packed()
    q, k, v = (t.detach() for t in qkv())
    out = CausalAttention()(q, k, v, mask=document_mask(documents))
    kk, vv = (t.repeat_interleave(2, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) / 8 ** 0.5
    scores = scores.masked_fill(~document_mask(documents), float("-inf"))
    want = torch.einsum("bhqk,bkhd->bqhd", F.softmax(scores, dim=-1), vv)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiled", [True, False])
def test_compiled_runs_ask_for_the_block_mask(process_group, compiled: bool) -> None:
    """The step hands a --doc-mask forward a context asking for the block mask with
    --compile only (flex's eager form is a dense reference, no cheaper than SDPA's mask);
    the model builds what the context asks, without gradients as the CPU allows."""
    model = tiny_model(ARGS)
    dims = ParallelDims(1, 1, 1, 1)
    dims.build_mesh("cpu")
    flags = ["--model", "debug", "--dtype", "fp32", "--doc-mask",
             *(["--compile", "--compile-backend", "aot_eager"] if compiled else [])]
    executor = build_executor([model], parse_args(flags), dims, torch.device("cpu"), eot_id=EOT)
    tokens, documents = packed()
    ctx = executor.context(executor.documents(tokens))
    assert ctx is not None and ctx.flex_mask is compiled
    torch.testing.assert_close(ctx.documents, documents)
    with torch.no_grad():
        _, mask = model.attention_inputs(ctx)
    assert isinstance(mask, flex.BlockMask) if compiled else isinstance(mask, torch.Tensor)


def test_the_planner_reads_flex_from_the_spec() -> None:
    """A family declares whether its attention takes the block mask (`flex_doc_mask`):
    loom's Llama-shaped families do; the transformers family does not."""
    assert family("llama").flex_doc_mask and family("deepseek-v3").flex_doc_mask
    assert not family("transformers").flex_doc_mask
