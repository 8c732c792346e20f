"""Under FSDP2 at dp 2, `--compile` trains the llama, qwen3 and MoE families for 10 steps
without a graph break or a recompile (#42): the one-process case, where the whole model is
one graph, is `tests/unit/parallel/test_single_device.py`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import run_ranks

FAMILIES = {"llama": ["--model", "debug"],
            "qwen3": ["--model", "debug", "--family", "qwen3"],
            "moe": ["--model", "moe-debug"]}
COMMON = ["--dataset", "random", "--vocab-size", "256", "--seq-len", "32", "--batch-size", "1",
          "--fp32", "--dp-shard", "2", "--compile", "--compile-backend", "aot_eager",
          "--max-steps", "10", "--log-every", "5"]
"""aot_eager: graph breaks and recompiles are Dynamo's, whatever backend generates the code."""


@pytest.mark.slow  # three compiled families on two ranks; the default case is one process
@pytest.mark.multirank
def test_compiled_families_at_dp2_neither_break_nor_recompile(tmp_path: Path) -> None:
    runs = {family: [*flags, *COMMON, "--outdir", str(tmp_path / family)]
            for family, flags in FAMILIES.items()}
    job = run_ranks(2, ["tests/workers/compile_counters_worker.py", json.dumps(runs)],
                    timeout=1200)
    assert job.ok, job.describe()  # a recompile raises inside the run
    counts = json.loads(job.ranks[0].stdout.strip().splitlines()[-1])
    assert sorted(counts) == sorted(FAMILIES)
    for family, seen in counts.items():
        assert seen["steps"] == 10 and not seen["graph_breaks"], (family, seen)
        # the blocks share one graph per kind of block (MoE's leading dense block is another);
        # the embedding, head and loss stay eager between FSDP2's units
        assert seen["graphs"] == (2 if family == "moe" else 1), (family, seen)
