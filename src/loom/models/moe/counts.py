"""How many parameters a token of a routed model uses: the count `loom plan` turns into
FLOPs and prints as "active per token"."""

from __future__ import annotations

from torch import nn


def per_token_param_count(model: nn.Module, top_k: int, n_experts: int) -> int:
    """Parameters one token multiplies through: every routed expert (the stacked 3-D weights)
    by top-k / E, the input embedding as the one row its lookup reads, the rest whole.

    The lookup is no matmul, so 6 x this count is the step's matmul FLOPs per token. It is
    also the one convention that meets DeepSeek's three published figures: V2 20.85B for
    "21B activated", V2-Lite 2.45B for "2.4B", V3 36.63B for "37B" (the whole table: 21.37B,
    2.66B, 37.55B; neither embedding nor head: 20.33B, 2.24B, 35.70B)."""
    routed = sum(p.numel() for p in model.parameters() if p.dim() == 3)
    rest = sum(p.numel() for p in model.parameters() if p.dim() != 3)
    embedding = model.get_submodule("tok_embeddings")
    assert isinstance(embedding, nn.Embedding)  # loom keeps even a tied head a weight of its own
    rest -= embedding.weight.numel() - embedding.embedding_dim
    return int(rest + routed * top_k / max(n_experts, 1))
