"""Small synthetic corpora for data tests: documents of words drawn from a list, seeded,
written as the JSONL or text files `--dataset` and `loom tokenize` read."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("river", "stone", "light", "the", "of", "a", "green", "house", "sea", "and")


def documents(words: tuple[str, ...] | list[str], count: int, seed: object,
              length: tuple[int, int] = (10, 80)) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(list(words), k=rng.randint(*length))) for _ in range(count)]


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path
