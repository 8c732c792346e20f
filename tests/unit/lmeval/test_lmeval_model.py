"""loom's lm-evaluation-harness wrapper: its rolling windows are the harness's own (each
token predicted once, the most context for each), and the scores it sums are the model's
log-probabilities of those tokens, however the windows and batches fall."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom.data.tokenizers import load_shipped_tokenizer
from loom.models.llama.model import ModelArgs
from tests.tiny import tiny_model

utils = pytest.importorskip("lm_eval.utils")
from loom.lmeval.model import LoomLM  # noqa: E402  (needs the harness)

ARGS = ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=50257, multiple_of=32,
                 max_seq_len=64)


class Request:
    def __init__(self, *args):
        self.args = args


def wrapper(context: int, batch_size: int = 3) -> LoomLM:
    return LoomLM(tiny_model(ARGS).eval(), load_shipped_tokenizer(), context,
                  torch.device("cpu"), batch_size)


@pytest.mark.parametrize("length, context", [(1, 4), (4, 4), (5, 4), (13, 4), (9, 1), (30, 7)])
def test_rolling_windows_are_the_harness_windows(length, context) -> None:
    lm = wrapper(context)
    ids = list(range(100, 100 + length))
    ours = [(seq[:-1], seq[-n:]) for seq, n in lm.rolling_windows(ids)]
    theirs = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
        ids, prefix_token=lm.tok.eot_id, max_seq_len=context, context_len=1)]
    # the harness scores the last len(pred) positions of context + pred[:-1]... as one input
    theirs = [(ctx + pred[:-1], pred) for ctx, pred in theirs]
    assert ours == theirs


def token_logprobs(lm: LoomLM, ids: list[int], before: list[int] | None = None) -> float:
    """The log-likelihood of `ids` after `before` (default: end-of-text), in one forward."""
    head = [lm.tok.eot_id] if before is None else before
    seq = torch.tensor([[*head, *ids]])
    with torch.no_grad():
        logprobs = F.log_softmax(lm.logits_of(seq[:, :-1]).float(), dim=-1)
    return float(logprobs[0, len(head) - 1:].gather(1, seq[0, len(head):, None]).sum())


def test_rolling_and_pair_scores_are_the_models_logprobs() -> None:
    texts = ["the river runs over the green stone", "a", "light of the north sea and wind"]
    lm = wrapper(context=64)
    rolled = lm.loglikelihood_rolling([Request(t) for t in texts])
    for text, got in zip(texts, rolled, strict=True):
        assert got == pytest.approx(token_logprobs(lm, lm.encode(text)), rel=1e-5)
    # a pair: the continuation given the context alone (as the harness's HF model scores it)
    pairs = lm.loglikelihood([Request("the river runs ", "over the green stone"),
                              Request("", "a")])
    head = lm.encode("the river runs")
    tail = lm.encode("the river runs over the green stone")[len(head):]
    assert pairs[0][0] == pytest.approx(token_logprobs(lm, tail, head), rel=1e-5)
    assert pairs[1][0] == pytest.approx(rolled[1], rel=1e-5)
    # windows shorter than the text: less context for the later tokens, another score
    short = wrapper(context=4).loglikelihood_rolling([Request(texts[0])])[0]
    assert short != pytest.approx(rolled[0], rel=1e-6) and short < 0
