"""A whole evaluation scores every token of a set once: windows overlapping by one token
(`for_evaluation`) and label-free windows filling the last global batch, at any dp degree
and batch size; training's packing keeps its windows apart."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from loom.data.loaders import build_dataloader
from loom.data.text import PackedTokens, window_count
from loom.losses import IGNORE_INDEX
from loom.trainer.evaluate import WholeBatches, scoring_view

META = {"pad_id": None, "eot_id": 0, "vocab_size": 1 << 16, "tokenizer": "ids"}


def packed(n_tokens: int, seq_len: int) -> PackedTokens:
    """Token i of the stream is the number i + 1 (so no label is the id 0 = end-of-text)."""
    return PackedTokens(np.arange(1, n_tokens + 1, dtype=np.int64), META, seq_len)


def scored_labels(n_tokens: int, seq_len: int, batch: int, dp: int) -> Counter:
    """Every label every dp rank's loader yields over one pass of the padded set."""
    whole = WholeBatches(scoring_view(packed(n_tokens, seq_len)), batch * dp)
    labels: Counter = Counter()
    for rank in range(dp):
        loader = build_dataloader(whole, batch_size=batch, dp_rank=rank, dp_size=dp, seed=0,
                                  num_workers=0, shuffle=False)
        for b in loader:
            labels.update(t for t in b["labels"].flatten().tolist() if t != IGNORE_INDEX)
    return labels


@pytest.mark.parametrize(("n_tokens", "seq_len", "batch", "dp"), [
    (10_000, 32, 3, 2), (10_000, 64, 1, 1), (1_000, 7, 4, 3), (33, 32, 2, 2), (2, 8, 1, 2)])
def test_every_token_after_the_first_is_scored_exactly_once(n_tokens, seq_len, batch, dp):
    labels = scored_labels(n_tokens, seq_len, batch, dp)
    assert labels == Counter(range(2, n_tokens + 1))  # token 1 is nobody's label


def test_padding_windows_score_nothing_and_only_fill_the_last_global_batch():
    view = scoring_view(packed(100, 8))
    whole = WholeBatches(view, 6)
    assert len(view) == window_count(100, 9, 8) == 13 and len(whole) == 18
    assert torch.equal(whole[12]["input"], view[12]["input"])
    assert (whole[13]["labels"] == IGNORE_INDEX).all() and whole[13]["input"].shape == (8,)


def test_training_windows_stay_apart_and_evaluation_windows_overlap_by_one():
    train = packed(30, 4)
    assert len(train) == 6 and train[1]["input"].tolist() == [6, 7, 8, 9]
    view = scoring_view(train)
    assert view[1]["input"].tolist() == [5, 6, 7, 8] and view[0]["labels"][-1] == 5
    assert len(train) == 6, "the view leaves the training set as it was"
