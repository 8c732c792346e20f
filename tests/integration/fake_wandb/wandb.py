"""Stand-in for the wandb package (tests only): records the calls loom makes, in order, as
JSON lines in $FAKE_WANDB_LOG, so the integration is checked without an account or the
real package."""

from __future__ import annotations

import json
import os
from typing import Any


def _record(*event: Any) -> None:
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps(event, default=str) + "\n")


class Histogram:
    def __init__(self, np_histogram: tuple[Any, Any]):
        counts, edges = np_histogram
        if len(edges) != len(counts) + 1:
            raise ValueError("a histogram needs one more edge than counts")


class _Summary(dict):
    def update(self, values: dict[str, Any]) -> None:  # type: ignore[override]
        _record("summary", sorted(values))
        super().update(values)


class Run:
    def __init__(self, name: str):
        self.name, self.summary = name, _Summary()

    def log(self, data: dict[str, Any], step: int) -> None:
        _record("log", step, sorted(data))

    def finish(self) -> None:
        _record("finish")


def init(project: str, name: str, dir: str, config: dict[str, Any]) -> Run:
    _record("init", project, name, dir, sorted(config))
    return Run(name)
