"""One rank of a compiled job: each run trains under Dynamo's `error_on_recompile` (a
recompile raises, and the job fails with it), and rank 0 prints, per run, the steps done,
the graph breaks and the number of graphs Dynamo made, as one JSON line."""

from __future__ import annotations

import json
import sys

import torch

from loom.trainer.parity import layout_training
from tests.workers.bootstrap import rank_job


def main(runs: dict[str, list[str]]) -> None:
    counts = {}
    with rank_job() as (info, device):
        for name, argv in runs.items():
            with layout_training(argv, info, device) as trainer:
                counters = torch._dynamo.utils.counters
                counters.clear()
                with torch._dynamo.config.patch(error_on_recompile=True):  # a config module
                    trainer.fit()
                counts[name] = {"steps": trainer.loop.step,
                                "graph_breaks": dict(counters["graph_break"]),
                                "graphs": counters["stats"]["unique_graphs"]}
        if info.rank == 0:
            print(json.dumps(counts))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
