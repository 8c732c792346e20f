import torch

from loom.models.context import ForwardContext
from loom.models.llama.model import CausalAttention, ModelArgs, apply_rope, rope_table
from tests.tiny import tiny_model

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=32,
                 max_seq_len=64)


def test_shapes_and_hidden_states():
    model = tiny_model(ARGS)
    tokens = torch.randint(ARGS.vocab_size, (2, 16))
    assert model(tokens).shape == (2, 16, ARGS.vocab_size)
    hidden = model(tokens, ctx=ForwardContext(hidden=True))
    assert hidden.shape == (2, 16, ARGS.dim)
    torch.testing.assert_close(model.output(hidden), model(tokens))


def test_attention_is_causal():
    model = tiny_model(ARGS)
    tokens = torch.randint(ARGS.vocab_size, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % ARGS.vocab_size
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_attention_keeps_keys_and_values_at_gqa_width():
    """Backward keeps K and V as the projections made them (2 heads), not widened to the
    query heads (8): the only full-width tensors saved are q and the output."""
    saved: list[tuple[int, ...]] = []
    q = torch.randn(2, 32, 8, 16, requires_grad=True)
    k, v = (torch.randn(2, 32, 2, 16, requires_grad=True) for _ in range(2))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                  lambda t: t):
        CausalAttention()(q, k, v)
    assert sum(shape[1] == 8 and len(shape) == 4 for shape in saved) <= 2, saved
    assert sum(shape[1] == 2 for shape in saved) >= 2, saved


def test_rope_preserves_norm_and_is_relative():
    table = rope_table(ModelArgs(dim=32, n_heads=2, max_seq_len=32))
    x = torch.randn(1, 8, 2, 16)
    torch.testing.assert_close(apply_rope(x, table).norm(dim=-1), x.norm(dim=-1))
    q, k = torch.randn(16), torch.randn(16)

    def score(i: int, j: int) -> torch.Tensor:
        qs = apply_rope(q.expand(1, 32, 1, 16).clone(), table)[0, i, 0]
        ks = apply_rope(k.expand(1, 32, 1, 16).clone(), table)[0, j, 0]
        return qs @ ks

    torch.testing.assert_close(score(5, 3), score(9, 7))


def test_module_names_are_the_contract():
    names = {n for n, _ in tiny_model(ARGS).named_parameters()}
    for expected in ("tok_embeddings.weight", "layers.0.attention.wq.weight",
                     "layers.1.feed_forward.w3.weight", "layers.0.ffn_norm.weight",
                     "layers.0.attention_norm.weight", "norm.weight", "output.weight"):
        assert expected in names
