"""--streaming: documents dealt to dp ranks, packed on the fly, and a saved position that
continues with exactly the next window (across pieces and epochs)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from loom.config import ConfigError
from loom.data import pieces as piece_plan
from loom.data.pieces import plan_pieces
from loom.data.streaming import PackedStream, Position, StreamSpec, saved_position
from loom.data.tokenizers import load_shipped_tokenizer

DOCS = [f"document {i} says " + "word " * (i % 7 * 5 + 3) for i in range(40)]


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> StreamSpec:
    path = tmp_path_factory.mktemp("stream") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(piece_plan, "PIECE_BYTES", 400)  # several pieces
        pieces = plan_pieces((Path(path),), "json")
    assert len(pieces) > 3
    return StreamSpec(tuple(pieces), "text", "train", load_shipped_tokenizer(), seq_len=15,
                      batches=0)


def take(stream: PackedStream, n: int) -> list[list[int]]:
    return list(itertools.islice(stream.windows(), n))


def test_dp_ranks_split_the_documents_and_cover_them_all(spec):
    tokenizer, ranks = spec.tokenizer, [PackedStream(spec, r, 2) for r in (0, 1)]
    seen = [[doc for pos, doc in itertools.takewhile(lambda x: x[0].epoch == 0,
                                                     s.documents(Position()))] for s in ranks]
    everything = [[*ids, tokenizer.eot_id] for ids in tokenizer.encode(DOCS)]
    assert sorted(seen[0] + seen[1]) == sorted(everything)
    assert abs(len(seen[0]) - len(seen[1])) <= len(spec.pieces), [len(s) for s in seen]
    assert not {tuple(d) for d in seen[0]} & {tuple(d) for d in seen[1]}


def test_a_saved_position_continues_with_the_next_window(spec):
    total = 120  # more than one epoch of this rank's tokens: the position wraps
    reference = PackedStream(spec, 1, 2)
    windows = reference.windows()
    expected, positions = [], []
    for _ in range(total):
        expected.append(next(windows))
        positions.append(reference.position)
    assert positions[-1].epoch >= 1 and all(len(w) == 16 for w in expected)
    for k in (0, 7, 33, 90):
        resumed = PackedStream(spec, 1, 2)
        resumed.position = positions[k]
        got = take(resumed, total - k - 1)
        assert got == expected[k + 1:], f"resumed after window {k} at {positions[k]}"


def test_a_rank_without_documents_fails_instead_of_waiting(spec):
    one_piece = StreamSpec(spec.pieces[:1], "text", "train", spec.tokenizer, 15, 0)
    with pytest.raises(ConfigError, match="no documents for dp rank"):
        take(PackedStream(one_piece, 63, 64), 1)


@pytest.mark.parametrize("saved", [
    {"epoch": 0, "piece": 1, "document": 2},  # a field missing
    {"epoch": 0, "piece": 1, "document": 2, "offset": 3, "extra": 0},
    {"epoch": 0, "piece": 1, "document": "2", "offset": 3},
    {"epoch": 0, "piece": True, "document": 2, "offset": 3},
    {"epoch": -1, "piece": 1, "document": 2, "offset": 3},
    {"epoch": 2 ** 70, "piece": 1, "document": 2, "offset": 3},
    [0, 1, 2, 3],
], ids=["missing", "extra", "string", "bool", "negative", "huge", "list"])
def test_a_saved_stream_position_is_checked(saved: object) -> None:
    """A checkpoint's stream position is read as four non-negative ints or refused."""
    with pytest.raises(ConfigError, match="stream position"):
        saved_position(saved)


def test_a_saved_stream_position_round_trips() -> None:
    position = Position(1, 2, 3, 4)
    assert saved_position(position._asdict()) == position and position > Position(1, 2, 3, 3)
